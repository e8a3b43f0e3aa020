"""Static checks of compose.yaml, the Dockerfile and .dockerignore (no Docker engine needed).

The tests whose names contain ``cli`` import ``outbox.cli``; the rest read files only.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"

EXPECTED_SERVICES = {
    "postgres",
    "redis",
    "migrate",
    "receiver",
    "relay",
    "worker",
    "sweeper",
    "flower",
}
LONG_RUNNING_APP_SERVICES = {"receiver", "relay", "worker", "sweeper"}
SHARED_ENV_KEYS = {"DATABASE_URL", "REDIS_URL", "ROUTES_FILE", "LOG_FORMAT"}
# Where the Dockerfile puts the build context inside the image.
IMAGE_APP_DIR = "/app/"
# Environment variables whose values are secrets: never written in compose.yaml.
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|BASIC_AUTH|(?:^|_)KEY$")
# A compose interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?m}.
INTERPOLATION = re.compile(
    r"\$\{(?P<var>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = compose["services"]
    assert isinstance(services, dict)
    return services


def _project_image(services: dict[str, dict[str, Any]]) -> str:
    """The image name of the one service that builds the project."""
    builders = [svc for svc in services.values() if "build" in svc]
    assert len(builders) == 1, "exactly one service builds the project's image"
    assert builders[0]["build"] == "."
    image = builders[0].get("image")
    assert isinstance(image, str) and image, "the building service names its image"
    return image


def _project_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    image = _project_image(services)
    return {name: svc for name, svc in services.items() if svc.get("image") == image}


def _depends_on(service: dict[str, Any]) -> dict[str, Any]:
    deps = service.get("depends_on", {})
    # The short (list) form has no condition; the checks below reject it.
    assert isinstance(deps, dict), f"depends_on must use the long form with conditions: {deps!r}"
    return deps


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments) pairs, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    return instructions


def _last(instructions: list[tuple[str, str]], keyword: str) -> str | None:
    """The arguments of the last `keyword` instruction of the final stage, or None."""
    found = None
    for kw, args in instructions:
        if kw == "FROM":
            found = None
        elif kw == keyword:
            found = args
    return found


def _cli_group() -> Any:
    typer_main = pytest.importorskip("typer.main")
    from outbox.cli import app

    group = typer_main.get_command(app)
    assert hasattr(group, "commands"), "the idem CLI must be a group of subcommands"
    return group


def _assert_cli_accepts(group: Any, argv: list[str], where: str) -> None:
    assert argv, f"{where}: empty command"
    name, *args = argv
    assert name in group.commands, (
        f"{where}: {name!r} is not an idem command (have {sorted(group.commands)})"
    )
    command = group.commands[name]
    # Parses the options exactly as the console script would, without running the command.
    with command.make_context(command.name, list(args), resilient_parsing=False):
        pass


def test_expected_services_exist(services: dict[str, dict[str, Any]]) -> None:
    """Compose defines every process of the gateway plus its PostgreSQL, Redis and Flower."""
    assert set(services) >= EXPECTED_SERVICES


def test_compose_has_no_version_key(compose: dict[str, Any]) -> None:
    """The file follows the Compose spec, which dropped the top-level version key."""
    assert "version" not in compose


def test_cli_accepts_every_project_image_command(services: dict[str, dict[str, Any]]) -> None:
    """Every service built from the project runs a real idem command whose options parse."""
    group = _cli_group()
    project = _project_services(services)
    assert {"migrate"} | LONG_RUNNING_APP_SERVICES <= set(project)
    for name, service in project.items():
        command = service.get("command")
        assert isinstance(command, list), f"{name}: command must be an exec-form list"
        _assert_cli_accepts(group, [str(part) for part in command], f"service {name}")


def test_cli_accepts_dockerfile_default_cmd() -> None:
    """The image's default CMD is an idem command whose options parse."""
    group = _cli_group()
    cmd = _last(_dockerfile_instructions(), "CMD")
    assert cmd is not None, "Dockerfile has no CMD"
    _assert_cli_accepts(group, json.loads(cmd), "Dockerfile CMD")


def test_depends_on_uses_conditions_on_healthchecked_services(
    services: dict[str, dict[str, Any]],
) -> None:
    """Every dependency has a condition; service_healthy only targets healthchecked services."""
    allowed = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, service in services.items():
        for target, spec in _depends_on(service).items():
            assert target in services, f"{name} depends on unknown service {target!r}"
            assert isinstance(spec, dict), f"{name} -> {target}: no condition"
            condition = spec.get("condition")
            assert condition in allowed, f"{name} -> {target}: condition {condition!r}"
            if condition == "service_healthy":
                assert "healthcheck" in services[target], (
                    f"{name} waits for {target} to be healthy, but {target} has no healthcheck"
                )


def test_migrate_is_one_shot_and_app_services_wait_for_it(
    services: dict[str, dict[str, Any]],
) -> None:
    """Migrate runs once when PostgreSQL is healthy; the app services start after it succeeded."""
    migrate = services["migrate"]
    assert migrate.get("restart") == "no"
    assert migrate["command"] == ["migrate"]
    assert _depends_on(migrate)["postgres"]["condition"] == "service_healthy"
    for name in LONG_RUNNING_APP_SERVICES:
        deps = _depends_on(services[name])
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_long_running_services_restart_unless_stopped(services: dict[str, dict[str, Any]]) -> None:
    """Every service except the one-shot migrate comes back after a crash or a daemon restart."""
    for name, service in services.items():
        if name == "migrate":
            continue
        assert service.get("restart") == "unless-stopped", name


def test_app_services_share_the_gateway_environment(services: dict[str, dict[str, Any]]) -> None:
    """Every project service gets the same DATABASE_URL, REDIS_URL, ROUTES_FILE and LOG_FORMAT."""
    project = _project_services(services)
    environments = [project[name].get("environment") for name in sorted(project)]
    for env in environments:
        assert isinstance(env, dict)
        assert set(env) >= SHARED_ENV_KEYS
    assert all(env == environments[0] for env in environments)
    env = environments[0]
    assert env["DATABASE_URL"].startswith("postgresql+psycopg://")
    assert "@postgres:" in env["DATABASE_URL"]
    assert env["REDIS_URL"].startswith("redis://redis:")
    assert env["LOG_FORMAT"] == "json"


def test_routes_file_is_mounted_from_the_users_folder(
    services: dict[str, dict[str, Any]],
) -> None:
    """ROUTES_FILE names a file bind-mounted read-only from the user's folder into every project
    service (the image carries no routes; a missing file is an error, not an empty folder)."""
    for name, service in _project_services(services).items():
        target = service["environment"]["ROUTES_FILE"]
        mounts = [v for v in service.get("volumes", []) if isinstance(v, dict)]
        mount = next((m for m in mounts if m.get("target") == target), None)
        assert mount is not None, f"{name}: {target} is not mounted"
        assert mount["type"] == "bind" and mount.get("read_only") is True, name
        assert mount.get("bind", {}).get("create_host_path") is False, name
        assert not target.startswith(IMAGE_APP_DIR), name
        source = INTERPOLATION.sub(lambda m: m.group("arg") or "", mount["source"])
        assert source.startswith("./"), f"{name}: routes come from {source!r}"
        assert _ignored(source.removeprefix("./")), "the user's routes file must stay out of images"


def test_receiver_healthcheck_probes_readyz(services: dict[str, dict[str, Any]]) -> None:
    """The receiver is healthy only when GET /readyz answers (database at head, broker up),
    probed with Python's urllib."""
    receiver = services["receiver"]
    test = receiver["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert test[1:3] == ["python", "-c"]
    assert "urllib" in test[3]
    assert "http://127.0.0.1:8000/readyz" in test[3]
    assert any(str(port).endswith(":8000") for port in receiver["ports"])


def test_redis_appendonly(services: dict[str, dict[str, Any]]) -> None:
    """Redis keeps queued tasks across restarts: AOF on, fsync every second, data on a volume."""
    redis = services["redis"]
    command = redis["command"]
    args = command if isinstance(command, list) else command.split()
    joined = " ".join(args)
    assert "--appendonly yes" in joined
    assert "--appendfsync everysec" in joined
    # A full broker refuses writes instead of evicting queued tasks; said, not left to a default.
    assert "--maxmemory-policy noeviction" in joined
    assert any(str(volume).endswith(":/data") for volume in redis["volumes"])
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])


def test_postgres_healthcheck_and_volume(services: dict[str, dict[str, Any]]) -> None:
    """PostgreSQL keeps its data on a named volume and reports readiness with pg_isready."""
    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:16")
    env = postgres["environment"]
    assert env["POSTGRES_USER"] == env["POSTGRES_DB"] == "idem"
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert any("/var/lib/postgresql/data" in str(volume) for volume in postgres["volumes"])


def test_named_volumes_are_declared(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    """Every named volume a service mounts is declared at the top level."""
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                if volume.get("type") != "volume":
                    continue
                source = str(volume["source"])
            else:
                source = str(volume).split(":", 1)[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source!r} is not declared"


def test_flower_basic_auth_comes_from_environment(services: dict[str, dict[str, Any]]) -> None:
    """Flower requires basic auth with a password taken from the environment, never this file."""
    flower = services["flower"]
    assert flower["image"] == "mher/flower:2.0"
    auth = flower["environment"]["FLOWER_BASIC_AUTH"]
    # user:password where the password is ${VAR:?msg} / ${VAR?msg}: required, with no default.
    match = re.fullmatch(
        r"(?:\$\{FLOWER_USER(?::-[^}]*)?\}|[^:$]+):\$\{(?P<var>[A-Z_][A-Z0-9_]*):?\?[^}]*\}",
        auth,
    )
    assert match, f"FLOWER_BASIC_AUTH must take the password from a required variable: {auth!r}"
    # Its API can shut workers down: published on the host's loopback only.
    assert flower["ports"] == ["127.0.0.1:5555:5555"]
    command = " ".join(flower["command"])
    assert "basic_auth" not in command
    assert "basic-auth" not in command
    assert _depends_on(flower)["redis"]["condition"] == "service_healthy"


def test_dockerfile_entrypoint_is_idem_and_user_is_not_root() -> None:
    """The image runs the idem console script as an unprivileged user."""
    instructions = _dockerfile_instructions()
    froms = [args for kw, args in instructions if kw == "FROM"]
    assert froms and froms[-1].startswith("python:3.11-slim")
    entrypoint = _last(instructions, "ENTRYPOINT")
    assert entrypoint is not None and json.loads(entrypoint) == ["idem"]
    user = _last(instructions, "USER")
    assert user is not None, "the final stage has no USER line, so it runs as root"
    assert user.split(":", 1)[0] not in {"root", "0"}
    assert any(kw == "EXPOSE" and "8000" in args.split() for kw, args in instructions)
    installs = [args for kw, args in instructions if kw == "RUN" and "pip install" in args]
    assert any("--no-cache-dir ." in args for args in installs)


def _dockerignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def _ignored(path: str) -> bool:
    """Whether any .dockerignore pattern excludes `path` or one of its parent folders."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in _dockerignore_patterns():
        if pattern.startswith("!"):
            continue
        # Docker anchors patterns at the context root; a leading **/ matches at any depth.
        anywhere = pattern.startswith("**/")
        bare = pattern.removeprefix("**/").strip("/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, bare) or (
                anywhere and fnmatch.fnmatch(Path(prefix).name, bare)
            ):
                return True
    return False


def test_dockerignore_excludes_local_state_but_keeps_build_inputs() -> None:
    """The build context leaves out virtualenvs, git and caches but keeps what pip needs."""
    for path in [
        ".venv",
        ".git",
        ".idem",
        "__pycache__",
        "outbox/__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
    ]:
        assert _ignored(path), f"{path} would be sent to the Docker build"
    for path in ["pyproject.toml", "README.md", "outbox", "worker", "migrations", "examples"]:
        assert not _ignored(path), f"{path} is needed in the image but .dockerignore drops it"
    assert not _ignored("constraints.txt")
    for path in ["tests", "bench", "docs", ".env", "routes.toml"]:
        assert _ignored(path), f"{path} would go into the image"


def _literal_secrets(name: str, value: Any) -> list[str]:
    """What in one environment entry is a secret written in the file instead of taken from the
    environment: a secret-named variable with text besides interpolations, an interpolation of
    a secret-named variable with a default, or a URL whose password is not an interpolation."""
    text = str(value)
    found = []
    for match in INTERPOLATION.finditer(text):
        secret = SECRET_NAME.search(match.group("var"))
        if secret and match.group("op") in ("-", ":-") and match.group("arg"):
            found.append(f"{name}: ${{{match.group('var')}}} has a default")
    if SECRET_NAME.search(name):
        rest = INTERPOLATION.sub("", text)
        if rest.strip(":@/ "):
            found.append(f"{name}: literal {rest!r}")
    url = re.match(r"^[a-z][a-z0-9+.-]*://[^:/@]*:(?P<password>[^@]*)@", text)
    if url is not None:
        password = url.group("password")
        whole = INTERPOLATION.fullmatch(password)
        if whole is None or whole.group("op") not in ("?", ":?"):
            found.append(f"{name}: the URL's password is not a required variable")
    return found


@pytest.mark.parametrize(
    ("name", "value", "literal"),
    [
        ("POSTGRES_PASSWORD", "idem", True),
        ("POSTGRES_PASSWORD", "${POSTGRES_PASSWORD:?set it}", False),
        ("OPERATOR_TOKEN", "${OPERATOR_TOKEN:-changeme}", True),
        ("METRICS_TOKEN", "${METRICS_TOKEN:-}", False),
        ("DATABASE_URL", "postgresql://idem:idem@postgres/idem", True),
        ("DATABASE_URL", "postgresql://idem:${PG:?x}@postgres/idem", False),
        ("FLOWER_BASIC_AUTH", "admin:secret", True),
        ("FLOWER_BASIC_AUTH", "${FLOWER_USER:-admin}:${FLOWER_PASSWORD:?x}", False),
        ("LOG_LEVEL", "INFO", False),
    ],
)
def test_the_literal_secret_check_itself(name: str, value: str, literal: bool) -> None:
    """The check below flags secrets written in the file and passes values taken from the
    environment."""
    assert bool(_literal_secrets(name, value)) is literal


def test_no_secret_is_written_in_compose(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    """Every password, token and secret comes from the environment (.env), required with
    `${VAR:?message}` or empty by default; none is written in compose.yaml."""
    found = []
    for name, service in services.items():
        environment = service.get("environment") or {}
        assert isinstance(environment, dict), f"{name}: environment must be a mapping"
        for key, value in environment.items():
            found += [f"{name}: {problem}" for problem in _literal_secrets(key, value)]
    assert not found, found


def test_required_secrets_are_in_the_env_example(compose: dict[str, Any]) -> None:
    """Every variable compose requires is named in .env.example, with how to make a secret."""
    required = {
        match.group("var")
        for match in INTERPOLATION.finditer(COMPOSE_FILE.read_text(encoding="utf-8"))
        if match.group("op") in ("?", ":?")
    }
    assert {"POSTGRES_PASSWORD", "OPERATOR_TOKEN", "FLOWER_PASSWORD"} <= required
    example = ENV_EXAMPLE.read_text(encoding="utf-8")
    for name in required:
        assert re.search(rf"^{name}=$", example, re.MULTILINE), f"{name} missing"
    assert "secrets.token_urlsafe(32)" in example


def test_every_long_running_service_has_a_healthcheck(
    services: dict[str, dict[str, Any]],
) -> None:
    """Every service that runs until stopped reports its health (none disabled)."""
    for name, service in services.items():
        if service.get("restart") == "no":
            continue
        check = service.get("healthcheck")
        assert isinstance(check, dict) and check.get("test"), f"{name} has no healthcheck"
        assert not check.get("disable"), name
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name


def test_relay_and_sweeper_report_liveness_with_idem_alive(
    services: dict[str, dict[str, Any]],
) -> None:
    """The relay's and the sweeper's healthchecks run `idem alive` on the heartbeat file their
    loops touch; the worker's pings its consumer."""
    group = _cli_group()
    env = services["relay"]["environment"]
    assert env["HEARTBEAT_FILE"].startswith("/tmp/")
    for name in ("relay", "sweeper"):
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "idem", "alive"], name
        _assert_cli_accepts(group, test[2:], f"{name} healthcheck")
    worker = " ".join(services["worker"]["healthcheck"]["test"])
    assert "inspect ping" in worker and "idem@$$HOSTNAME" in worker


def _seconds(duration: str) -> float:
    """A compose duration such as 1m30s, 45s or 500ms, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(number) * units[unit] for number, unit in parts)


def test_worker_grace_period_covers_a_lease_and_its_margin(
    services: dict[str, dict[str, Any]],
) -> None:
    """`docker compose stop` gives the worker more than a lease, a renewal and the margin to
    finish its running attempt before SIGKILL (Docker's default is 10 s)."""
    from outbox.core.timeouts import minimum_stop_grace

    worker = services["worker"]
    lease = INTERPOLATION.fullmatch(worker["environment"]["LEASE_SECONDS"])
    assert lease is not None and lease.group("op") == ":-"
    grace = _seconds(str(worker.get("stop_grace_period", "10s")))
    assert grace >= minimum_stop_grace(float(lease.group("arg"))), grace


def test_one_image_name_for_every_project_service(services: dict[str, dict[str, Any]]) -> None:
    """One service builds the project's image under one name; the other app services run that
    image by name and build nothing."""
    image = _project_image(services)
    project = _project_services(services)
    assert {"migrate"} | LONG_RUNNING_APP_SERVICES <= set(project)
    assert all(svc["image"] == image for svc in project.values())
    assert [name for name, svc in project.items() if "build" in svc] == ["migrate"]


def test_dockerfile_installs_pinned_dependencies_before_the_code() -> None:
    """The image installs the runtime dependencies with the constraints file from a layer that
    only pyproject.toml and constraints.txt invalidate, then the code without resolving again;
    no extra (embedded servers, test tools) goes in."""
    instructions = _dockerfile_instructions()
    steps = [(kw, args) for kw, args in instructions if kw in ("COPY", "RUN")]
    copies = [i for i, (kw, _) in enumerate(steps) if kw == "COPY"]
    first, code = steps[copies[0]][1], copies[-1]
    assert first.split()[:-1] == ["pyproject.toml", "constraints.txt"], first
    assert steps[code][1].split()[0] == ".", "the code is copied last"
    deps = [args for kw, args in steps[copies[0] : code] if kw == "RUN" and "pip install" in args]
    assert deps and "-c constraints.txt" in deps[0] and "['dependencies']" in deps[0]
    project = [args for kw, args in steps[code:] if kw == "RUN" and "pip install" in args]
    assert project and "--no-deps" in project[0] and "[" not in project[0]
