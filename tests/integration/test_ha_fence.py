"""The fence holds across a failover: a worker frozen while it held a lease, across a Patroni
switchover, writes late and is refused on the new primary.

A real two-node Patroni cluster (etcd, a synchronous standby) on network namespaces of its own
(tests/chaos/ha_cluster.py). A holder process claims a key through the multi-host URL, is
frozen (SIGSTOP: its renewals stop, as a worker's do in a long GC pause or a stalled VM), the
primary is switched over, the lease runs out, another holder claims the key on the new primary
and records its effect; then the frozen one is thawed and sends its own success with its old
fence. Its connection was to the old primary (now a standby, restarted by Patroni): it
reconnects, finds the new primary, and its write matches no row. The key keeps the second
holder's result and fence: the lease, the fence and the result written before the switchover
are all on the new primary (synchronous replication).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox.core.settings import Settings
from outbox.store.engines import create_sync_engine
from outbox.store.migrate import upgrade
from tests.chaos import ha_cluster, netns
from tests.support import ROOT, query, seed_pending_key
from worker.store import Claim, KeyStore

LEASE_SECONDS = 3
HOSTS = {"client": 10, "etcd": 19, "pg-1": 21, "pg-2": 22}
HOLDER = """
import sys
from outbox.core.settings import Settings
from outbox.store.engines import create_sync_engine
from worker.store import KeyStore

url, key, lease = sys.argv[1], sys.argv[2], float(sys.argv[3])
settings = Settings(database_url=url, redis_url="redis://unused", db_timeout_seconds=2)
store = KeyStore(create_sync_engine(settings, autocommit=True))
claim = store.claim(key, "frozen-host:1:1", lease)
print(f"claimed {claim.fence}", flush=True)
sys.stdin.readline()
print("wrote" if store.succeed(claim, {"by": "frozen"}, None) else "refused", flush=True)
"""


@pytest.fixture
def cluster() -> Iterator[tuple[netns.Network, ha_cluster.Cluster]]:
    reason = netns.unavailable() or ha_cluster.unavailable()
    if reason is not None:
        pytest.skip(f"the Patroni cluster cannot run here: {reason}")
    net = netns.Network(HOSTS)
    base = Path(tempfile.mkdtemp(prefix="idem-ha-fence-"))
    cluster = ha_cluster.Cluster(net, base / "cluster", ["pg-1", "pg-2"])
    try:
        net.build()
        with net.entered("client"):
            cluster.start()
            yield net, cluster
    finally:
        cluster.stop()
        assert net.close() == []


def _line(process: subprocess.Popen[str], timeout: float = 60) -> str:
    assert process.stdout is not None
    if not select.select([process.stdout], [], [], timeout)[0]:
        raise AssertionError(f"no line from the holder within {timeout:g} s")
    return process.stdout.readline().strip()


def test_a_holder_frozen_across_a_switchover_is_refused_by_the_fence(
    cluster: tuple[netns.Network, ha_cluster.Cluster],
) -> None:
    _, patroni = cluster
    url = patroni.database_url()
    upgrade(url)
    key = seed_pending_key(url, "frozen-across-switchover")
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, key, str(LEASE_SECONDS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LOG_LEVEL": "WARNING"},
    ) as holder:
        try:
            first_fence = int(_line(holder).removeprefix("claimed "))
            holder.send_signal(signal.SIGSTOP)
            old = patroni.switchover()
            deadline = time.monotonic() + 60
            while patroni.leader() in (None, old) or not _writable(url):
                assert time.monotonic() < deadline, patroni.members()
                time.sleep(0.2)
            # The frozen holder's lease, read on the new primary, runs out.
            while query(url, "SELECT locked_until > now() FROM idempotency_keys")[0][0]:
                time.sleep(0.2)
            _claim_and_succeed(url, key, first_fence + 1)
            holder.send_signal(signal.SIGCONT)
            assert holder.stdin is not None
            holder.stdin.write("write now\n")
            holder.stdin.flush()
            assert _line(holder) == "refused"
        finally:
            holder.kill()
    assert query(url, "SELECT status, fence, result->>'by' FROM idempotency_keys") == [
        ("succeeded", first_fence + 1, "fresh")
    ]
    # The node the frozen holder first wrote to is a standby now.
    roles = {m["name"]: m["role"] for m in patroni.members()}
    assert roles[old] != "leader"


def _writable(url: str) -> bool:
    """A read-write session opens: Patroni names the new leader before its promotion has
    ended, and meanwhile every node refuses one ("session is read-only", or restarting)."""
    try:
        query(url, "SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


def _claim_and_succeed(url: str, key: str, fence: int) -> None:
    """Another holder takes the key on the new primary, with the next fence, and records its
    effect."""
    engine = create_sync_engine(Settings(database_url=url, redis_url="unused"), autocommit=True)
    try:
        store = KeyStore(engine)
        fresh = store.claim(key, "fresh-host:2:2", LEASE_SECONDS)
        assert isinstance(fresh, Claim)
        assert fresh.fence == fence
        assert store.succeed(fresh, {"by": "fresh"}, None) is True
    finally:
        engine.dispose()
