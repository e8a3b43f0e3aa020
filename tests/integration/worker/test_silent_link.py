"""A worker's statement on a link that went silent fails; it does not wait for the link.

Finding 6 of the multi-host soak (docs/explanation/reliability.md): the statement timeout is
enforced by
the server, and a server that never sees the statement never enforces it, so a pool process
waited in its statement until the partition healed. The test puts PostgreSQL behind a
forwarder on a "db" network namespace, connects from a "worker" namespace, then drops every
packet between the two (no refusal, no reset) while a statement is sent.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from outbox.core.settings import Settings
from outbox.store.engines import create_sync_engine
from tests.chaos import netns
from tests.support import pump

DB_TIMEOUT_SECONDS = 1.0
# What the test waits for the statement at most: far above the bound (2 s here), far below
# what TCP alone takes to give up (about 15 minutes), so only the bound can end it in time.
PATIENCE_SECONDS = 60


@pytest.fixture
def network() -> Iterator[netns.Network]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"the silent link needs network namespaces: {reason}")
    network = netns.Network({"db": 20, "worker": 51})
    try:
        network.build()
        yield network
    finally:
        assert network.close() == []


def _forward(network: netns.Network, database_port: int) -> socket.socket:
    """A listener on the db host's address whose connections are forwarded, from this
    process's own namespace, to the machine's PostgreSQL (a socket stays in the namespace it
    was made in; the accepting thread runs outside)."""
    with network.entered("db"):
        listener = socket.create_server((network.ip("db"), 0))

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", database_port), timeout=5)
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


def test_a_statement_on_a_silent_link_fails_within_the_bound(
    network: netns.Network, own_database: str
) -> None:
    """Connected and answering, then every packet dropped both ways: the next statement ends
    in "database unavailable" (an OperationalError) after about two statement timeouts
    (`engines.SILENT_LINK_TIMEOUTS`), instead of hanging until the link heals."""
    url = make_url(own_database)
    listener = _forward(network, url.port or 5432)
    forwarded = url.set(host=network.ip("db"), port=listener.getsockname()[1])
    settings = Settings(
        database_url=forwarded.render_as_string(hide_password=False),
        redis_url="redis://unused",
        db_timeout_seconds=DB_TIMEOUT_SECONDS,
    )
    engine = create_sync_engine(settings, pool_size=1, max_overflow=0, autocommit=True)
    try:
        with network.entered("worker"), engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
            network.cut("db", "worker")
            started = time.monotonic()
            ended: list[BaseException] = []

            def statement() -> None:
                try:
                    conn.execute(text("SELECT 2"))
                except BaseException as error:  # what ended it is the assertion
                    ended.append(error)

            waiting = threading.Thread(target=statement, daemon=True)
            waiting.start()
            waiting.join(PATIENCE_SECONDS)
            took = time.monotonic() - started
            assert not waiting.is_alive(), f"the statement still waits after {took:.0f} s"
            assert len(ended) == 1 and isinstance(ended[0], OperationalError), ended
            network.uncut("db", "worker")
    finally:
        engine.dispose()
        listener.close()
