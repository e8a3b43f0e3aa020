"""Static checks of compose.yaml, the Dockerfile and .dockerignore (no Docker engine needed).

The tests whose names contain ``cli`` import ``outbox.cli``; the rest read files only.
"""

from __future__ import annotations

import fnmatch
import ipaddress
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
    "proxy",
    "edge",
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


def test_app_services_reach_the_same_database_and_broker(
    services: dict[str, dict[str, Any]],
) -> None:
    """Every project service gets the same DATABASE_URL and logs JSON; every one that uses the
    broker gets the same REDIS_URL, which carries the broker's password."""
    project = _project_services(services)
    environments = {name: project[name].get("environment") for name in sorted(project)}
    for name, env in environments.items():
        assert isinstance(env, dict), name
        assert env["LOG_FORMAT"] == "json", name
    (database_url,) = {env["DATABASE_URL"] for env in environments.values()}
    assert database_url.startswith("postgresql+psycopg://")
    assert "@postgres:" in database_url
    brokers = {name: env["REDIS_URL"] for name, env in environments.items() if "REDIS_URL" in env}
    assert set(brokers) == LONG_RUNNING_APP_SERVICES
    (redis_url,) = set(brokers.values())
    assert redis_url.startswith("redis://:${REDIS_PASSWORD:?") and "@redis:" in redis_url


# Who needs which secret: the receiver verifies signatures and serves the token-holding
# endpoints; the worker runs routes; the relay, the sweeper and migrate need the database (and
# the broker) only. The passwords inside DATABASE_URL and REDIS_URL are the stores' own.
RECEIVER_ONLY = {
    "OPERATOR_TOKEN",
    "CLAIMS_TOKEN",
    "REPLAY_SECRET",
    "METRICS_TOKEN",
    "WEBHOOK_SECRETS",
    "STRIPE_WEBHOOK_SECRET",
    "GITHUB_WEBHOOK_SECRET",
    "SHOPIFY_CLIENT_SECRET",
    "ACME_WEBHOOK_SECRET",
    "BILLING_WEBHOOK_SECRET",
}
STORE_PASSWORDS = {"POSTGRES_PASSWORD", "REDIS_PASSWORD"}


def _secrets_read(environment: dict[str, Any]) -> set[str]:
    """The secret-named variables an environment sets or interpolates."""
    found = {key for key in environment if SECRET_NAME.search(key)}
    for value in environment.values():
        found |= {
            match.group("var")
            for match in INTERPOLATION.finditer(str(value))
            if SECRET_NAME.search(match.group("var"))
        }
    return found


def test_each_service_gets_only_the_secrets_it_uses(services: dict[str, dict[str, Any]]) -> None:
    """The tokens and the providers' secrets reach the receiver only: the worker, the relay,
    the sweeper and migrate see no token and no signing secret, only the passwords of the
    stores they use; no service takes an env_file (which would hand it everything)."""
    assert all("env_file" not in service for service in services.values())
    receiver = _secrets_read(services["receiver"]["environment"])
    assert receiver >= RECEIVER_ONLY
    for name in ("worker", "relay", "sweeper", "migrate"):
        seen = _secrets_read(services[name]["environment"])
        assert seen <= STORE_PASSWORDS, f"{name} gets {sorted(seen - STORE_PASSWORDS)}"
    worker = services["worker"]["environment"]
    assert not {"OPERATOR_TOKEN", "CLAIMS_TOKEN", "WEBHOOK_SECRETS"} & set(worker)
    assert "REDIS_PASSWORD" not in _secrets_read(services["migrate"]["environment"])


def test_flowers_password_is_judged_before_flower_starts(
    services: dict[str, dict[str, Any]],
) -> None:
    """Flower's password reaches the receiver, which judges it with the tokens at start, and
    Flower waits for a healthy receiver, so a guessable password stops Flower from serving."""
    flower = services["flower"]
    assert "${FLOWER_PASSWORD:?" in flower["environment"]["FLOWER_BASIC_AUTH"]
    assert services["receiver"]["environment"]["FLOWER_PASSWORD"].startswith("${FLOWER_PASSWORD:?")
    assert flower["depends_on"]["receiver"] == {"condition": "service_healthy"}


def test_the_workers_environment_loads_the_example_routes(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing but the worker's compose environment, the worker reads
    examples/routes.toml as it does (routes, not [[sources]]); the receiver's reading, which
    needs the providers' secrets, would fail there."""
    from outbox.core.routes import RoutesError, load_routes

    worker = services["worker"]["environment"]
    example = ROOT / "examples" / "routes.toml"
    for match in INTERPOLATION.finditer(example.read_text(encoding="utf-8")):
        monkeypatch.delenv(match.group("var"), raising=False)
    for name, value in worker.items():
        monkeypatch.setenv(name, INTERPOLATION.sub(lambda m: m.group("arg") or "x", str(value)))
    assert load_routes(example, sources=False).resolve("crm.lead.created") is not None
    with pytest.raises(RoutesError, match=r"WEBHOOK_SECRET|CLIENT_SECRET"):
        load_routes(example)


def test_routes_file_is_mounted_from_the_users_folder(
    services: dict[str, dict[str, Any]],
) -> None:
    """ROUTES_FILE names a file bind-mounted read-only from the user's folder into the services
    that read it, the receiver and the worker (the image carries no routes; a missing file is
    an error, not an empty folder)."""
    readers = {
        name
        for name, service in _project_services(services).items()
        if "ROUTES_FILE" in service["environment"]
    }
    assert readers == {"receiver", "worker"}
    for name in readers:
        service = services[name]
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


def _command_options(command: list[str] | str) -> dict[str, str]:
    """`--name value` pairs of a command line."""
    args = [str(arg) for arg in (command if isinstance(command, list) else command.split())]
    return {
        arg.removeprefix("--"): args[i + 1]
        for i, arg in enumerate(args[:-1])
        if arg.startswith("--")
    }


def _bytes(size: str) -> int:
    """A Docker or Redis size (512m, 1g, 256mb) in bytes."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", size.strip().lower())
    assert match, size
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def test_redis_appendonly(services: dict[str, dict[str, Any]]) -> None:
    """Redis keeps queued tasks across restarts: AOF on, fsync every second, data on a volume."""
    redis = services["redis"]
    options = _command_options(redis["command"])
    assert options["appendonly"] == "yes"
    assert options["appendfsync"] == "everysec"
    assert any(str(volume).endswith(":/data") for volume in redis["volumes"])
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])


def test_redis_is_bounded_and_asks_for_a_password(services: dict[str, dict[str, Any]]) -> None:
    """`noeviction` applies only under a `maxmemory`: Redis has one, below its container's
    memory limit (room for the AOF rewrite's fork), so when full it refuses new tasks instead of
    growing until it is killed or evicting queued ones. Every client must give the password,
    a required variable; the healthcheck gives it through REDISCLI_AUTH."""
    redis = services["redis"]
    options = _command_options(redis["command"])
    assert options["maxmemory-policy"] == "noeviction"
    maxmemory = INTERPOLATION.sub(lambda m: m.group("arg") or "", options["maxmemory"])
    assert 0 < _bytes(maxmemory) <= _bytes(redis["mem_limit"]) // 2
    password = INTERPOLATION.fullmatch(options["requirepass"])
    assert password is not None and password.group("op") == ":?"
    assert password.group("var") == "REDIS_PASSWORD"
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")
    urls = [
        value
        for service in services.values()
        for key, value in (service.get("environment") or {}).items()
        if str(value).startswith("redis://")
    ]
    assert len(urls) >= 5
    assert all(url.startswith("redis://:${REDIS_PASSWORD:?") for url in urls), urls
    assert all(
        "redis://redis" not in " ".join(map(str, s.get("command") or [])) for s in services.values()
    )


def test_rabbitmq_runs_with_its_profile_only_and_the_gateway_follows_broker_url(
    services: dict[str, dict[str, Any]],
) -> None:
    """RabbitMQ is a profile (`docker compose up` without it starts Redis only): its data on a
    volume under a fixed hostname (its node name), its password from the environment, with no
    default; the app services and Flower wait for it only when it runs, every app service that
    uses the broker takes BROKER_URL from the environment (empty: Redis), and the worker's
    healthcheck and Flower reach the broker BROKER_URL names."""
    rabbitmq = services["rabbitmq"]
    assert rabbitmq["profiles"] == ["rabbitmq"]
    assert all("profiles" not in s for name, s in services.items() if name != "rabbitmq")
    assert rabbitmq["hostname"] == "rabbitmq"
    assert "rabbitmqdata:/var/lib/rabbitmq" in rabbitmq["volumes"]
    assert rabbitmq["environment"]["RABBITMQ_DEFAULT_PASS"] == "${RABBITMQ_PASSWORD:-}"
    assert 'test -n "$$RABBITMQ_DEFAULT_PASS"' in rabbitmq["command"][-1]
    for name in LONG_RUNNING_APP_SERVICES | {"flower"}:
        dependency = _depends_on(services[name])["rabbitmq"]
        assert dependency == {"condition": "service_healthy", "required": False}, name
        assert services[name]["environment"]["BROKER_URL"] == "${BROKER_URL:-}", name
    worker = " ".join(services["worker"]["healthcheck"]["test"])
    assert '--broker "$${BROKER_URL:-$$REDIS_URL}"' in worker
    assert (
        'CELERY_BROKER_URL="$${BROKER_URL:-$$CELERY_BROKER_URL}"'
        in services["flower"]["command"][-1]
    )


# Capabilities a service gets back after dropping all, and why.
CAPABILITIES_ADDED = {
    # Caddy runs as root in its image and binds 80 and 443.
    "proxy": {"NET_BIND_SERVICE"},
}
# Services whose root filesystem stays writable, and why: none.
WRITABLE_ROOT: dict[str, str] = {}


def test_every_service_is_hardened(services: dict[str, dict[str, Any]]) -> None:
    """Every service runs with a read-only root filesystem, all capabilities dropped (a few
    added back where named above), no privilege gain through setuid binaries, and memory, CPU
    and process limits that compose applies without swarm (service-level keys)."""
    for name, service in services.items():
        if name not in WRITABLE_ROOT:
            assert service.get("read_only") is True, f"{name}: root filesystem is writable"
        assert service.get("cap_drop") == ["ALL"], name
        assert set(service.get("cap_add", [])) <= CAPABILITIES_ADDED.get(name, set()), name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert "deploy" not in service, f"{name}: use mem_limit/cpus, honoured without swarm"
        assert _bytes(str(service.get("mem_limit", "0"))) > 0, f"{name}: no memory limit"
        assert float(service.get("cpus", 0)) > 0, f"{name}: no CPU limit"
        assert int(service.get("pids_limit", 0)) > 0, f"{name}: no process limit"


def _tmpfs_targets(service: dict[str, Any]) -> set[str]:
    mounts = [v for v in service.get("volumes", []) if isinstance(v, dict)]
    return {m["target"] for m in mounts if m.get("type") == "tmpfs"} | set(service.get("tmpfs", []))


def test_what_a_process_writes_is_on_a_tmpfs_or_a_volume(
    services: dict[str, dict[str, Any]],
) -> None:
    """Read-only roots leave the writes each process makes somewhere to go: /tmp in memory for
    every project service and Flower (heartbeat files, the worker's metrics files), PostgreSQL's
    socket folder, and the data folders on named volumes."""
    for name in _project_services(services):
        assert "/tmp" in _tmpfs_targets(services[name]), name
    for name in ("relay", "sweeper"):
        heartbeat = services[name]["environment"]["HEARTBEAT_FILE"]
        assert heartbeat.startswith("/tmp/"), name
    assert "/tmp" in _tmpfs_targets(services["flower"])
    assert "/var/run/postgresql" in _tmpfs_targets(services["postgres"])
    proxy_volumes = [str(v) for v in services["proxy"]["volumes"] if isinstance(v, str)]
    assert {v.split(":")[1] for v in proxy_volumes} >= {"/data", "/config"}


# An exact version: 1.2.3, optionally a variant (-bookworm, -alpine), optionally a digest.
# PostgreSQL numbers its releases major.minor (16.10), so two parts are exact there.
PINNED_IMAGE = re.compile(
    r"^(?:postgres:\d+\.\d+|[\w./-]+:\d+\.\d+\.\d+)(?:-[\w.-]+)?(?:@sha256:[0-9a-f]{64})?$"
)


@pytest.mark.parametrize(
    ("image", "pinned"),
    [
        ("postgres:16", False),
        ("redis:7", False),
        ("mher/flower:2.0", False),
        ("python:3.11-slim", False),
        ("caddy:latest", False),
        ("caddy", False),
        ("postgres:16.10-bookworm", True),
        ("caddy:2.10.2", True),
        ("redis:7.4.6@sha256:" + "0" * 64, True),
    ],
)
def test_the_pinned_image_check_itself(image: str, pinned: bool) -> None:
    """Only an exact version (with or without a variant or digest) counts as pinned."""
    assert bool(PINNED_IMAGE.match(image)) is pinned


def test_every_image_is_pinned_to_an_exact_version(services: dict[str, dict[str, Any]]) -> None:
    """Every image pulled from a registry names an exact version (no `latest`, no major-only
    tag that moves under a redeploy); the project's own image is built from a Dockerfile whose
    base image is pinned the same way."""
    project = _project_image(services)
    for name, service in services.items():
        if service["image"] == project:
            continue
        assert PINNED_IMAGE.match(service["image"]), f"{name}: {service['image']}"
    froms = [args.split()[0] for kw, args in _dockerfile_instructions() if kw == "FROM"]
    assert froms and all(PINNED_IMAGE.match(image) for image in froms), froms


def _published(service: dict[str, Any]) -> list[str]:
    return [str(port) for port in service.get("ports", [])]


def test_only_the_proxy_is_published_beyond_this_host(services: dict[str, dict[str, Any]]) -> None:
    """The proxy publishes 80 and 443; every other published port (the receiver's, Flower's)
    binds this host's loopback only; PostgreSQL and Redis publish none."""
    assert sorted(_published(services["proxy"])) == ["443:443", "80:80"]
    for name, service in services.items():
        if name == "proxy":
            continue
        for port in _published(service):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    assert _published(services["receiver"]) == ["127.0.0.1:${RECEIVER_PORT:-8000}:8000"]
    assert not _published(services["postgres"]) and not _published(services["redis"])


def _members(services: dict[str, dict[str, Any]], network: str) -> set[str]:
    return {name for name, s in services.items() if network in (s.get("networks") or [])}


def test_the_receiver_trusts_x_forwarded_for_from_the_proxy_only(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    """FORWARDED_ALLOW_IPS is written in the file (not taken from the environment, where `*`
    could come in) and is exactly the edge's fixed address on the network it shares with the
    receiver, a network with a fixed subnet and no other member; the edge believes the
    X-Forwarded-For of the proxy's fixed address only, on their own network."""
    allowed = services["receiver"]["environment"]["FORWARDED_ALLOW_IPS"]
    assert "$" not in allowed and "*" not in allowed
    edge_networks = services["edge"]["networks"]
    assert set(edge_networks) == {"proxy", "edge"}
    assert edge_networks["edge"]["ipv4_address"] == allowed
    (subnet,) = [c["subnet"] for c in compose["networks"]["edge"]["ipam"]["config"]]
    assert ipaddress.ip_address(allowed) in ipaddress.ip_network(subnet)
    assert _members(services, "edge") == {"edge", "receiver"}
    proxy_networks = services["proxy"]["networks"]
    assert list(proxy_networks) == ["proxy"]
    assert _members(services, "proxy") == {"proxy", "edge"}
    edge_conf = (ROOT / "examples" / "nginx-edge.conf").read_text(encoding="utf-8")
    believed = re.findall(r"^\s*set_real_ip_from\s+([^;]+);", edge_conf, re.MULTILINE)
    assert believed == [proxy_networks["proxy"]["ipv4_address"]]


def test_the_edge_caps_connections_per_client_and_bounds_every_wait(
    services: dict[str, dict[str, Any]],
) -> None:
    """The edge (nginx, examples/nginx-edge.conf) allows 64 connections per client address
    (the address Caddy saw, through real_ip), answers 429 past it, bounds the headers, the body
    and the answer's sending, takes 1 MiB bodies, and forwards to the receiver only with the
    client's address in X-Forwarded-For."""
    edge = services["edge"]
    mount = next(v for v in edge["volumes"] if isinstance(v, dict) and v["type"] == "bind")
    assert mount["target"] == "/etc/nginx/nginx.conf" and mount["read_only"] is True
    conf = (ROOT / "examples" / "nginx-edge.conf").read_text(encoding="utf-8")
    code = "\n".join(line.split("#", 1)[0].strip() for line in conf.splitlines())
    for line in (
        "real_ip_header X-Forwarded-For;",
        "limit_conn_zone $binary_remote_addr zone=per_client:10m;",
        "limit_conn per_client 64;",
        "limit_conn_status 429;",
        "client_header_timeout 10s;",
        "client_body_timeout 10s;",
        "send_timeout 10s;",
        "client_max_body_size 1m;",
        "server receiver:8000;",
        "proxy_set_header X-Forwarded-For $remote_addr;",
    ):
        assert f"\n{line}\n" in f"\n{code}\n", line
    assert code.count("proxy_pass") == 1 and "proxy_pass http://receiver;" in code
    assert _depends_on(edge)["receiver"]["condition"] == "service_healthy"
    assert _depends_on(services["proxy"])["edge"]["condition"] == "service_healthy"


def test_the_docs_proxy_example_publishes_the_intake_only() -> None:
    """Every Caddyfile the proxy guide shows forwards only POST /v1/events and /v1/webhooks/*
    and answers 404 to everything else (the claims, the operator API, the console, /metrics),
    as docs/explanation/security.md says the proxy does."""
    guide = (ROOT / "docs/how-to/behind-a-proxy.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```caddyfile\n(.*?)```", guide, re.DOTALL)
    assert blocks
    for block in blocks:
        code = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
        assert re.search(r"@intake \{\s*method POST\s*path /v1/events /v1/webhooks/\*\s*\}", code)
        assert code.count("reverse_proxy") == 1
        assert code.index("handle @intake") < code.index("reverse_proxy")
        assert re.search(r"handle \{\s*respond 404\s*\}", code), block


# `*` given as the trusted proxies, in any file a user copies from.
TRUST_EVERYONE = re.compile(
    r"(?:FORWARDED_ALLOW_IPS\s*[=:]\s*|--forwarded-allow-ips[= ])[\"'`]?\*", re.IGNORECASE
)


def _env_example_entries() -> list[str]:
    """.env.example cut into entries: the comment lines above a variable, and its line."""
    entries, current = [], []
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        current.append(line)
        if re.match(r"#?\s*[A-Z0-9_]+=", line) or not line.strip():
            entries.append("\n".join(current))
            current = []
    return [*entries, "\n".join(current)]


def test_no_file_suggests_trusting_every_proxy() -> None:
    """Neither compose.yaml, .env.example, the Caddyfile nor the docs set or suggest
    FORWARDED_ALLOW_IPS=* (with it any client names itself 127.0.0.1)."""
    files = [COMPOSE_FILE, ENV_EXAMPLE, ROOT / "README.md", ROOT / "examples" / "Caddyfile"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for path in files:
        found = TRUST_EVERYONE.search(path.read_text(encoding="utf-8"))
        assert found is None, f"{path.name}: {found.group(0) if found else ''}"
    for entry in _env_example_entries():
        if "FORWARDED_ALLOW_IPS" in entry:
            assert not re.search(r"(?<![\w*])\*(?![\w*])", entry), entry


def test_the_proxy_forwards_the_intake_with_the_clients_address(
    services: dict[str, dict[str, Any]],
) -> None:
    """The proxy runs the Caddyfile from examples/: TLS for IDEM_DOMAIN, only POST /v1/events
    and /v1/webhooks/* forwarded (to the edge, then the receiver), everything else 404; it
    believes no incoming X-Forwarded-For (no trusted_proxies), so the edge gets the address
    Caddy saw."""
    proxy = services["proxy"]
    mount = next(v for v in proxy["volumes"] if isinstance(v, dict) and v["type"] == "bind")
    assert mount["target"] == "/etc/caddy/Caddyfile" and mount["read_only"] is True
    assert mount["source"] == "${CADDYFILE_HOST:-./examples/Caddyfile}"
    caddyfile = (ROOT / "examples" / "Caddyfile").read_text(encoding="utf-8")
    code = "\n".join(line.split("#", 1)[0] for line in caddyfile.splitlines())
    assert "{$IDEM_DOMAIN" in code
    assert re.search(r"path /v1/events /v1/webhooks/\*\n", code)
    assert code.count("reverse_proxy") == 1 and "reverse_proxy edge:8080" in code
    assert "respond 404" in code
    assert "trusted_proxies" not in code and "X-Forwarded-For" not in code
    assert "max_header_size" in code and "read_header" in code
    assert _depends_on(proxy)["edge"]["condition"] == "service_healthy"


def test_postgres_healthcheck_and_volume(services: dict[str, dict[str, Any]]) -> None:
    """PostgreSQL keeps its data on a named volume and reports readiness with pg_isready."""
    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:16.")
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
    assert flower["image"].startswith("mher/flower:2.0.")
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
    assert froms and froms[-1].startswith("python:3.11.")
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


def test_dockerignore_keeps_node_and_tool_output_out() -> None:
    """n8n's install (.n8n/), npm packages and builds (node_modules/, dist/ at any depth, the
    Idem node's folder), the fuzzers' databases, test and benchmark output never reach the
    build context, and the Dockerfile copies nothing from outside it."""
    for path in [
        ".n8n",
        ".n8n/node_modules/n8n",
        "node_modules",
        "dist",
        "integrations/n8n-nodes-idem",
        "integrations/n8n-nodes-idem/node_modules",
        "examples/n8n/node_modules",
        "outbox/dist",
        ".hypothesis",
        ".schemathesis",
        ".import_linter_cache",
        "test-artifacts",
        "bench/results",
        ".constraints-venv",
    ]:
        assert _ignored(path), f"{path} would be sent to the Docker build"
    copies = [args.split() for kw, args in _dockerfile_instructions() if kw in ("COPY", "ADD")]
    assert all(kw == "COPY" for kw, _ in _dockerfile_instructions() if kw in ("COPY", "ADD"))
    for *sources, _target in copies:
        for source in sources:
            assert not source.startswith("--from"), "one stage: nothing copied from elsewhere"
            assert source == "." or not _ignored(source), source
            assert not source.startswith(("/", "..")), source


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
    # The name it pings is the worker's own (unset, a worker is named idem-<pid>@host).
    assert services["worker"]["environment"]["WORKER_NAME"] == "idem@%h"


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
