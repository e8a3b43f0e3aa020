"""What operators and callers see of lanes on the real path (receiver, relay, worker, sweeper):
a lane a dead letter blocks is listed by `idem stuck` once, with its head and the keys parked
behind it, and a superseded event's repeat names the version that won."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.core.keys import mask_key
from outbox.store import embedded
from tests.integration.worker.test_lanes import (
    Recorder,
    _accepted,
    _routes,
    _send,
    _settled,
    _started,
    _states,
)
from tests.support import ROOT, Downstream, Stack, query, wait_until


@pytest.fixture
def lanes_stack(own_database: str, downstream: Downstream, tmp_path: Path) -> Iterator[Stack]:
    """The gateway's processes on a database and a Redis of this test's own, with ordered
    routes (`ledger`: acceptance order, block; `stamped`: supersede by timestamp)."""
    downstream.reset()
    redis_process, url = embedded.start_redis(tmp_path / "redis", appendonly=False)
    stack = Stack(own_database, url, _routes(tmp_path / "routes.toml", downstream.url), tmp_path)
    yield _started(stack)
    stack.stop_all()
    redis_process.terminate()
    redis_process.wait(timeout=10)


def _stuck(stack: Stack) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "stuck", "--older-than", "0s", "--json"],
        env={**os.environ, **stack.env()},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_stuck_lists_the_lane_a_dead_letter_blocks(
    lanes_stack: Stack, downstream: Downstream
) -> None:
    """The second update of an account is refused for good: `idem stuck` lists its lane once,
    with the dead-lettered head and the two updates parked behind it (not as stuck keys), and
    not the account whose lane went on."""
    stack = lanes_stack
    recorder = Recorder(downstream, delay=0.0)
    recorder.refuse.add(2)
    keys = [_accepted(stack, recorder, "ledger.entry", "acct-1", n) for n in range(1, 5)]
    other = _accepted(stack, recorder, "ledger.entry", "acct-2", 1)
    wait_until(lambda: _settled(stack, [keys[0], keys[1], other]), timeout=30)
    wait_until(
        lambda: (
            [s for s, _ in _states(stack, keys[2:]).values()] == ["pending", "pending"]
            and query(
                stack.database_url,
                "SELECT count(*) FROM idempotency_keys WHERE error_code = 'lane_waiting'",
            )
            == [(2,)]
        ),
        timeout=30,
    )
    found = _stuck(stack)
    assert found.returncode == 1, found.stderr
    doc = json.loads(found.stdout)
    assert doc["keys"] == []
    [lane] = doc["blocked_lanes"]
    (dead_letter,) = query(
        stack.database_url,
        "SELECT id FROM dead_letters WHERE idempotency_key = %s AND resolution = 'open'",
        (keys[1],),
    )[0]
    assert {k: lane[k] for k in ("route", "lane", "head_key", "head_status", "waiting")} == {
        "route": "ledger",
        "lane": "crm:acct-1",
        "head_key": mask_key(keys[1]),
        "head_status": "failed_final",
        "waiting": 2,
    }
    assert (lane["head_error_code"], lane["dead_letter_id"]) == ("http_422", dead_letter)
    assert recorder.applied["acct-1"] == [1]


def test_a_repeat_of_a_superseded_update_names_the_version_that_won(
    lanes_stack: Stack, downstream: Downstream
) -> None:
    """An update stamped before the applied one is superseded without a call; sent again, it
    is answered 200 `superseded` with the applied version, which the key's page shows too."""
    stack = lanes_stack
    recorder = Recorder(downstream, delay=0.0)
    newer = _accepted(stack, recorder, "stamped.updated", "s1", "2026-12-01T10:00:00Z")
    wait_until(lambda: _settled(stack, [newer]), timeout=30)
    older = _accepted(stack, recorder, "stamped.updated", "s1", "2026-12-01T09:00:00Z")
    wait_until(lambda: _settled(stack, [older]), timeout=30)
    repeat = _send(stack, "stamped.updated", "s1", "2026-12-01T09:00:00Z")
    assert repeat.status_code == 200 and repeat.headers["idempotent-replayed"] == "true"
    body = repeat.json()
    assert (body["key"], body["status"]) == (older, "superseded")
    assert body["superseded_by"] == "2026-12-01T10:00:00Z"
    with stack.client() as client:
        shown = client.get(f"/v1/events/{older}").json()
    assert (shown["lane"], shown["superseded_by"]) == ("crm:s1", "2026-12-01T10:00:00Z")
    assert downstream.effects == {newer: 1}
