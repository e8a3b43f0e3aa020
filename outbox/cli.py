"""`idem`: run the gateway's processes, or all of them at once with `idem dev`.

The entry point: the process commands are here, each context's terminal commands are
registered from its own module (`outbox.operate.commands`, `outbox.operate.watch`,
`outbox.maintenance.commands`), and their shared conventions are in `outbox.terminal`.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import typer

from outbox.core.logs import get_logger
from outbox.core.settings import dev_env_file, get_settings
from outbox.maintenance.commands import purge_command
from outbox.operate.attempts import show_command
from outbox.operate.commands import deliver_command, dlq_app, replay_command
from outbox.operate.watch import routes_app, stats_command, stuck_command
from outbox.terminal import fail, load_settings

app = typer.Typer(
    help="Exactly-once side effects for automation workflows.",
    no_args_is_help=True,
    add_completion=False,
)
log = get_logger("idem")


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, _: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@app.command()
def serve(
    host: str = typer.Option(None, help="Interface to bind (env HOST, default 127.0.0.1)."),
    port: int = typer.Option(None, help="Port to listen on (env PORT, default 8000)."),
    workers: int = typer.Option(1, help="Receiver processes."),
) -> None:
    """Run the HTTP receiver."""
    import uvicorn

    from outbox.core.connections import ProxyTrustError, server_options

    settings = load_settings()
    host, port = host or settings.host, port or settings.port
    try:
        bounds = server_options(settings)
    except ProxyTrustError as error:
        fail(str(error))
    # uvicorn's own start-up lines are left out (outbox/core/logs.py); a port already taken
    # is still its ERROR line.
    log.info("receiver.starting", url=f"http://{host}:{port}", workers=workers)
    uvicorn.run(
        "outbox.app:create_server",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_config=None,
        access_log=False,
        server_header=False,
        **bounds,
    )


@app.command()
def relay() -> None:
    """Publish due outbox rows to the broker until stopped."""
    from outbox.core import tracing
    from outbox.relay.loop import run_relay
    from outbox.relay.publisher import create_publisher
    from outbox.store.engines import create_relay_engine

    settings = load_settings()
    stop = threading.Event()
    _stop_on_signals(stop)
    tracing.setup("idem-relay")
    engine = create_relay_engine(settings)
    try:
        run_relay(settings, engine, create_publisher(settings), stop)
    finally:
        engine.dispose()
        tracing.shutdown()


@app.command()
def sweep(
    once: bool = typer.Option(False, "--once", help="One pass, then exit."),
) -> None:
    """Re-drive keys whose lease expired or whose message was lost (one sweeper acts at a time)."""
    from outbox.core.routes import load_routes
    from outbox.maintenance.sweeper import run_sweeper, sweep_once
    from outbox.store.engines import create_sync_engine

    # Routes, not sources: the sweeper verifies no signature; it reads the [[notify]] targets.
    settings = load_settings(sources=False)
    notify = load_routes(settings.routes_file, sources=False).notify
    # The notifier holds a session lock across its sends: a session of its own.
    session = settings.session_url()
    if session is None:
        fail(
            "the sweeper needs a session of its own (its notifier holds a session lock): with "
            "DATABASE_POOL_MODE=transaction, set DATABASE_DIRECT_URL to PostgreSQL itself"
        )
    engine = create_sync_engine(settings, url=session)
    try:
        if once:
            report = sweep_once(engine, settings, notify)
            typer.echo(
                "another sweeper holds the lock"
                if report is None
                else f"leases_reclaimed={report.leases_reclaimed} redriven={report.redriven}"
            )
            return
        stop = threading.Event()
        _stop_on_signals(stop)
        run_sweeper(settings, engine, stop, notify)
    finally:
        engine.dispose()


@app.command()
def worker(
    concurrency: int = typer.Option(
        None, help="Attempts in flight: threads, or processes under prefork (WORKER_CONCURRENCY)."
    ),
    pool: str = typer.Option(None, help="threads (default) or prefork (WORKER_POOL)."),
) -> None:
    """Run the Celery worker that claims keys and runs actions."""
    # Routes, not sources: the worker needs no provider's secret (docs/explanation/security.md).
    load_settings(sources=False)
    args = [sys.executable, "-m", "worker"]
    if concurrency:
        args += ["--concurrency", str(concurrency)]
    if pool:
        args += ["--pool", pool]
    os.execv(sys.executable, args)


@app.command()
def alive(
    max_age: float = typer.Option(60.0, help="Seconds the heartbeat file may be old."),
) -> None:
    """Exit 0 while this container's relay or sweeper turns its loop (HEARTBEAT_FILE is
    recent), 1 otherwise: the liveness check of the processes that serve no HTTP."""
    from outbox.core.heartbeat import age_seconds

    path = get_settings().heartbeat_file
    if path is None:
        fail("HEARTBEAT_FILE is not set")
    age = age_seconds(path)
    if age is None or age > max_age:
        typer.echo(
            f"idem: {path} " + ("is missing" if age is None else f"is {age:.0f} s old"), err=True
        )
        raise typer.Exit(1)
    typer.echo(f"alive: heartbeat {age:.0f} s ago")


@app.command()
def migrate() -> None:
    """Apply the database migrations (Alembic upgrade to head)."""
    from outbox.store.migrate import upgrade

    # The database only: migrations need neither the broker nor any route or source.
    settings = load_settings(need_servers=False, sources=False)
    if not settings.database_url:
        fail("DATABASE_URL is not set")
    # A migration is a session's work (its DDL and Alembic's version row in one transaction,
    # on PostgreSQL itself); through a transaction pool only with DATABASE_DIRECT_URL.
    session = settings.session_url()
    if session is None:
        fail("with DATABASE_POOL_MODE=transaction, set DATABASE_DIRECT_URL to migrate")
    log.info("migrations.applied", revision=upgrade(session))


@app.command()
def dev(
    concurrency: int = typer.Option(
        None, help="Worker attempts in flight (default: WORKER_CONCURRENCY or the pool's)."
    ),
) -> None:
    """Run everything in the foreground: migrations, receiver, relay, worker, sweeper. Ctrl-C
    (or SIGTERM to this process) stops all.

    With no DATABASE_URL / BROKER_URL (nor REDIS_URL), embedded PostgreSQL and Redis start with
    their data in DATA_DIR (default .idem/). Their URLs and the operator token (OPERATOR_TOKEN,
    else one made for this run) are written to DATA_DIR/env, where every `idem` command started
    from the same folder finds them.
    """
    from outbox.store import embedded
    from outbox.store.migrate import upgrade

    os.environ.setdefault("LOG_FORMAT", "console")
    # On a developer's machine the API's schema and its viewers help; production leaves them off.
    os.environ.setdefault("API_DOCS", "true")
    _clear_stale_dev_env()
    get_settings.cache_clear()
    settings = load_settings(need_servers=False)
    env = dict(os.environ)
    servers: list[Any] = []
    redis_process: subprocess.Popen[bytes] | None = None
    data_dir = Path(settings.data_dir).resolve()
    shared: dict[str, str] = {}
    try:
        if not settings.database_url:
            server, shared["DATABASE_URL"] = embedded.start_postgres(data_dir / "postgres")
            servers.append(server)
            log.info("embedded.postgres", data_dir=str(data_dir / "postgres"), port=server.port)
        if not settings.broker():
            redis_process, shared["REDIS_URL"] = embedded.start_redis(data_dir / "redis")
            log.info("embedded.redis", url=shared["REDIS_URL"])
    except RuntimeError as error:
        for server in servers:
            server.cleanup()
        fail(str(error))
    if not settings.operator_token:
        shared["OPERATOR_TOKEN"] = secrets.token_urlsafe(32)
    env.update(shared)
    env_file = _write_dev_env(shared)
    revision = upgrade(env.get("DATABASE_URL") or settings.database_url)
    log.info("migrations.applied", revision=revision)
    commands = {
        "receiver": [sys.executable, "-m", "outbox.cli", "serve"],
        "relay": [sys.executable, "-m", "outbox.cli", "relay"],
        "worker": [
            sys.executable,
            "-m",
            "worker",
            *(["--concurrency", str(concurrency)] if concurrency else []),
        ],
        "sweeper": [sys.executable, "-m", "outbox.cli", "sweep"],
    }
    # Each child in a process group of its own: a terminal's Ctrl-C reaches this process only,
    # which then stops each child once (a Celery worker told twice prints its shutdown twice).
    children = {
        name: subprocess.Popen(cmd, env=env, process_group=0) for name, cmd in commands.items()
    }
    url = f"http://{settings.host}:{settings.port}"
    log.info("dev.started", url=url, processes=sorted(children), pid=os.getpid())
    _explain_operator_token(url, shared.get("OPERATOR_TOKEN"), env_file)
    _explain_claims_token(url, settings.claims_token)
    stop = threading.Event()
    _stop_on_signals(stop)
    exit_code = 0
    try:
        while not stop.wait(0.5):
            exited = {n: p.returncode for n, p in children.items() if p.poll() is not None}
            if exited:
                log.error("dev.process_exited", exited=exited)
                exit_code = 1
                break
    finally:
        env_file.unlink(missing_ok=True)
        embedded.terminate(list(children.values()))
        if redis_process is not None:
            embedded.terminate([redis_process])
        for server in servers:
            server.cleanup()
        log.info("dev.stopped")
    raise typer.Exit(exit_code)


def _clear_stale_dev_env() -> None:
    """Refuse while another `idem dev` of this folder runs; forget the file a killed one left."""
    env_file = dev_env_file()
    if not env_file.is_file():
        return
    for line in env_file.read_text().splitlines():
        if line.startswith("IDEM_DEV_PID="):
            pid = int(line.partition("=")[2] or 0)
            if pid and pid != os.getpid() and Path(f"/proc/{pid}").exists():
                fail(f"another `idem dev` (pid {pid}) runs with {env_file}; stop it first")
    env_file.unlink()


def _write_dev_env(values: dict[str, str]) -> Path:
    """Write what this run made (embedded servers' URLs, an operator token) where every `idem`
    command reads it (readable by this user only: it holds a password and a token)."""
    env_file = dev_env_file()
    env_file.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Written by `idem dev` for the `idem` commands of other shells; removed when it stops.",
        f"IDEM_DEV_PID={os.getpid()}",
        *(f"{name}={value}" for name, value in values.items()),
    ]
    descriptor = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write("\n".join(lines) + "\n")
    return env_file


def _explain_operator_token(url: str, made: str | None, env_file: Path) -> None:
    """Say how an operator reaches this gateway: the token, the console, the commands."""
    log.info(
        "dev.operator",
        token=made or "OPERATOR_TOKEN (set in the environment)",
        console=f"{url}/console",
        commands=f"idem stats, idem dlq list, ... from this folder (they read {env_file})",
    )


def _explain_claims_token(url: str, token: str) -> None:
    """Say how a workflow reaches the claims API of this gateway."""
    example = (
        f"curl -X POST {url}/v1/claims -H 'Authorization: Bearer $CLAIMS_TOKEN'"
        """ -H 'Content-Type: application/json' -d '{"key": "crm:lead-42"}'"""
    )
    if token:
        log.info(
            "dev.claims_api", auth="CLAIMS_TOKEN is set: send it as a bearer token", example=example
        )
    else:
        log.info(
            "dev.claims_api",
            auth="CLAIMS_TOKEN is unset, so only clients on this machine are served",
            to_require_a_token="start with CLAIMS_TOKEN=$(python -c 'import secrets;"
            " print(secrets.token_urlsafe(32))') idem dev",
            example=example,
        )


@app.command()
def demo() -> None:
    """Tell the story this product was built for: a lost CRM answer, a redelivery, one task.

    Starts a fake CRM and the whole gateway (embedded servers unless DATABASE_URL / BROKER_URL
    are set), prints each step, and stops everything. Run it from the project's folder.
    """
    # The examples are not installed with the package: they are found from the project's folder.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        from examples.demo import main
    except ModuleNotFoundError as error:
        if error.name not in ("examples", "examples.demo", "examples.fake_crm"):
            raise
        fail("idem demo runs from the project's folder (it uses examples/)")
    raise typer.Exit(main())


# The contexts' commands: operators' (outbox/operate/), the purge (outbox/maintenance/).
app.add_typer(dlq_app, name="dlq")
app.command("replay")(replay_command)
app.command("deliver")(deliver_command)
app.command("show")(show_command)
app.command("stuck")(stuck_command)
app.command("purge")(purge_command)
app.command("stats")(stats_command)
app.add_typer(routes_app, name="routes")

if __name__ == "__main__":
    app()
