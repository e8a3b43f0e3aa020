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
LONG_RUNNING_APP_SERVICES = {"receiver", "relay", "worker"}
SHARED_ENV_KEYS = {"DATABASE_URL", "REDIS_URL", "ROUTES_FILE", "LOG_FORMAT"}
# Where the Dockerfile puts the build context inside the image.
IMAGE_APP_DIR = "/app/"


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


def _project_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services.items() if svc.get("build") == "."}


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


def test_routes_file_ships_in_the_image(services: dict[str, dict[str, Any]]) -> None:
    """ROUTES_FILE points at a file of the build context that .dockerignore lets into the image."""
    routes = services["receiver"]["environment"]["ROUTES_FILE"]
    assert routes.startswith(IMAGE_APP_DIR)
    relative = routes.removeprefix(IMAGE_APP_DIR)
    assert (ROOT / relative).is_file(), f"{relative} is missing from the repository"
    assert not _ignored(relative)


def test_receiver_healthcheck_probes_healthz(services: dict[str, dict[str, Any]]) -> None:
    """The receiver is healthy only when GET /healthz answers, probed with Python's urllib."""
    receiver = services["receiver"]
    test = receiver["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert test[1:3] == ["python", "-c"]
    assert "urllib" in test[3]
    assert "http://127.0.0.1:8000/healthz" in test[3]
    assert "8000:8000" in receiver["ports"]


def test_redis_appendonly(services: dict[str, dict[str, Any]]) -> None:
    """Redis keeps queued tasks across restarts: AOF on, fsync every second, data on a volume."""
    redis = services["redis"]
    command = redis["command"]
    args = command if isinstance(command, list) else command.split()
    joined = " ".join(args)
    assert "--appendonly yes" in joined
    assert "--appendfsync everysec" in joined
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
