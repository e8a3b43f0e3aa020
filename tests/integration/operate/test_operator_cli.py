"""The operators' commands (`idem dlq`, `replay`, `stuck`, `purge`, `stats`) as real processes.

Each test fills a database of its own with rows written directly (no receiver or worker runs
against it, so they stay as written), runs `python -m outbox.cli ...` and checks the output,
the exit code and the rows afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from outbox.core.keys import mask_key
from tests.support import ROOT, query, seed_lane_key, seed_pending_key

Idem = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def idem(own_database: str, redis_url: str, routes_file: Path) -> Idem:
    """Runs `idem ARGS...` against the test's own database; keyword arguments add to the env."""
    env = {
        **os.environ,
        "DATABASE_URL": own_database,
        "REDIS_URL": redis_url,
        "ROUTES_FILE": str(routes_file),
        "PYTHONPATH": str(ROOT),
        "USER": "tester",
        # Wide enough that rich never shortens a cell the tests look for.
        "COLUMNS": "250",
    }

    def run(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "outbox.cli", *args],
            env={**env, **extra_env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


def ok_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def key_for(name: str, event_type: str = "crm.lead.created", source: str = "webform") -> str:
    """A key shaped like a derived one: `source:event_type:sha256`."""
    return f"{source}:{event_type}:{hashlib.sha256(name.encode()).hexdigest()}"


def add_key(
    db: str,
    name: str,
    status: str,
    *,
    event_type: str = "crm.lead.created",
    route: str = "crm",
    age: str = "1 hour",
    expires_in: str = "30 days",
    lease: str = "-1 minute",
    payload: dict[str, Any] | None = None,
    duplicates: int = 0,
    blocked: int = 0,
    reclaimed: int = 0,
) -> str:
    """A key (with its event) last changed `age` ago; a processing one holds a lease ending
    `lease` from now."""
    key = key_for(name, event_type)
    query(
        db,
        """
        INSERT INTO idempotency_keys (
            idempotency_key, status, payload_hash, correlation_id, source, event_type, route,
            attempts, lease_owner, locked_until, created_at, updated_at, expires_at,
            duplicate_count, blocked_deliveries, reclaimed_count)
        VALUES (
            %(key)s, %(status)s, 'hash', %(name)s, 'webform', %(event_type)s, %(route)s, 1,
            CASE WHEN %(status)s = 'processing' THEN 'worker-1' END,
            CASE WHEN %(status)s = 'processing' THEN now() + CAST(%(lease)s AS interval) END,
            now() - CAST(%(age)s AS interval), now() - CAST(%(age)s AS interval),
            now() + CAST(%(expires_in)s AS interval), %(duplicates)s, %(blocked)s, %(reclaimed)s)
        """,
        {
            "key": key,
            "status": status,
            "name": name,
            "event_type": event_type,
            "route": route,
            "lease": lease,
            "age": age,
            "expires_in": expires_in,
            "duplicates": duplicates,
            "blocked": blocked,
            "reclaimed": reclaimed,
        },
    )
    query(
        db,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        " VALUES (%s, 'webform', %s, %s, %s)",
        (key, event_type, name, json.dumps(payload or {"name": name})),
    )
    return key


def add_dead_letter(
    db: str, key: str, kind: str = "permanent", resolution: str = "open", error: str = "http_422"
) -> int:
    rows = query(
        db,
        """
        INSERT INTO dead_letters (
            idempotency_key, kind, error_code, error_detail, attempts, first_failed_at,
            last_failed_at, resolution, resolved_by, resolved_at)
        VALUES (%(key)s, %(kind)s, %(error)s, 'the CRM said no', 3, now() - interval '2 hours',
                now() - interval '1 hour', %(resolution)s,
                CASE WHEN %(resolution)s <> 'open' THEN 'someone' END,
                CASE WHEN %(resolution)s <> 'open' THEN now() END)
        RETURNING id
        """,
        {"key": key, "kind": kind, "error": error, "resolution": resolution},
    )
    return int(rows[0][0])


def add_outbox(
    db: str, key: str, *, available_in: str = "0 s", published_ago: str | None = None
) -> None:
    query(
        db,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at,"
        " published_at, created_at) VALUES (%s, 'idem.process', 'c',"
        " now() + CAST(%s AS interval), now() - CAST(%s AS interval),"
        " now() - COALESCE(CAST(%s AS interval), '0 s'))",
        (key, available_in, published_ago, published_ago),
    )


def count(db: str, sql: str, params: Any = None) -> int:
    return int(query(db, sql, params)[0][0])


def test_dlq_list_filters_by_kind_event_type_and_status(own_database: str, idem: Idem) -> None:
    """`dlq list --json` returns the dead letters each filter (kind, event-type glob, status,
    window) selects, newest first."""
    db = own_database
    lead = add_dead_letter(db, add_key(db, "lead", "failed_final"), "permanent")
    deal = add_dead_letter(
        db, add_key(db, "deal", "failed_final", event_type="crm.deal.won"), "retries_exhausted"
    )
    ping = add_key(db, "ping", "quarantined", event_type="plain.ping", route="plain")
    pinged = add_dead_letter(db, ping, "quarantined", resolution="discarded")

    def ids(*args: str) -> list[int]:
        return [item["id"] for item in ok_json(idem("dlq", "list", "--json", *args))["items"]]

    assert ids() == [pinged, deal, lead]
    assert ids("--kind", "permanent") == [lead]
    assert ids("--event-type", "crm.*") == [deal, lead]
    assert ids("--event-type", "crm.deal.*", "--status", "open") == [deal]
    assert ids("--status", "discarded") == [pinged]
    assert ids("--status", "open", "--kind", "quarantined") == []
    assert ids("--source", "stripe") == []
    assert ids("--since", "10m") == [pinged, deal, lead]
    assert ids("--until", "10m") == []
    item = ok_json(idem("dlq", "list", "--json", "--kind", "quarantined"))["items"][0]
    assert item["key"] == ping and item["masked_key"] == mask_key(ping)
    assert (item["event_type"], item["status"], item["attempts"]) == ("plain.ping", "discarded", 3)
    refused = idem("dlq", "list", "--since", "yesterday")
    assert refused.returncode == 2 and refused.stderr.startswith("idem: --since:")
    assert idem("dlq", "list", "--kind", "bogus").returncode == 2


def test_dlq_list_pages_with_a_cursor_and_masks_keys(own_database: str, idem: Idem) -> None:
    """Pages follow the cursor to the end, and the table shows masked keys and the next-page
    hint."""
    db = own_database
    keys = [add_key(db, f"k{i}", "failed_final") for i in range(3)]
    first, second, third = (add_dead_letter(db, key) for key in keys)
    page = ok_json(idem("dlq", "list", "--json", "--limit", "2"))
    assert [i["id"] for i in page["items"]] == [third, second]
    assert page["next_cursor"] == second
    rest = ok_json(idem("dlq", "list", "--json", "--limit", "2", "--cursor", str(second)))
    assert [i["id"] for i in rest["items"]] == [first] and rest["next_cursor"] is None
    table = idem("dlq", "list", "--limit", "2")
    assert table.returncode == 0, table.stderr
    assert f"next page: --cursor {second}" in table.stdout
    assert mask_key(keys[2]) in table.stdout and keys[2] not in table.stdout
    assert "http_422" in table.stdout and "failed" in table.stdout
    empty = idem("dlq", "list", "--status", "replayed")
    assert empty.returncode == 0 and "no dead letters match" in empty.stdout


def test_dlq_show_prints_the_masked_payload_and_history(own_database: str, idem: Idem) -> None:
    """`dlq show` prints the payload with secrets masked, the last error and every dead letter
    of the key; an unknown id exits 2."""
    db = own_database
    payload = {"email": "ada@example.com", "api_token": "tok-123", "card": {"password": "pw-9"}}
    key = add_key(db, "ada", "failed_final", payload=payload)
    earlier = add_dead_letter(db, key, "retries_exhausted", resolution="replayed", error="timeout")
    latest = add_dead_letter(db, key, "permanent")
    shown = idem("dlq", "show", str(latest))
    assert shown.returncode == 0, shown.stderr
    assert "ada@example.com" in shown.stdout and "[redacted]" in shown.stdout
    assert "tok-123" not in shown.stdout and "pw-9" not in shown.stdout
    for text in ("history", "the CRM said no", "http_422", "timeout", "retries_exhausted", key):
        assert text in shown.stdout
    found = ok_json(idem("dlq", "show", str(latest), "--json"))
    assert found["payload"]["api_token"] == "[redacted]"
    assert found["payload"]["card"] == {"password": "[redacted]"}
    assert [h["id"] for h in found["history"]] == [earlier, latest]
    assert found["last_error"] == {"error_code": "http_422", "detail": "the CRM said no"}
    missing = idem("dlq", "show", "999999")
    assert missing.returncode == 2
    assert "idem: no dead letter has id 999999" in missing.stderr


def test_discard_closes_an_open_dead_letter_once(own_database: str, idem: Idem) -> None:
    """`dlq discard` closes an open dead letter with the reason and operator on record (then it
    lists as discarded); a closed or unknown one exits 2."""
    db = own_database
    first = add_dead_letter(db, add_key(db, "one", "failed_final"))
    second = add_dead_letter(db, add_key(db, "two", "failed_final"))
    done = idem("dlq", "discard", str(first), "--reason", "sent by hand", "--by", "alice")
    assert done.returncode == 0, done.stderr
    assert f"discarded dead letter {first}" in done.stdout
    assert ok_json(idem("dlq", "discard", str(second), "--reason", "dup", "--json")) == {
        "id": second,
        "status": "discarded",
    }
    listed = ok_json(idem("dlq", "list", "--status", "discarded", "--json"))["items"]
    assert {(i["id"], i["resolved_by"]) for i in listed} == {(first, "alice"), (second, "tester")}
    assert query(db, "SELECT resolution_note FROM dead_letters WHERE id = %s", (first,)) == [
        ("sent by hand",)
    ]
    again = idem("dlq", "discard", str(first), "--reason", "again")
    assert again.returncode == 2 and "no longer open" in again.stderr
    assert idem("dlq", "discard", "999999", "--reason", "x").returncode == 2
    assert idem("dlq", "discard", str(first), "--reason", "  ").returncode == 2
    assert ok_json(idem("dlq", "list", "--status", "open", "--json"))["items"] == []


def test_replay_dry_run_then_confirm_replays_once(own_database: str, idem: Idem) -> None:
    """A dry run changes nothing and prints the confirm command; running it resets the keys to
    pending with one outbox row each, marks their dead letters replayed and writes an audit
    row; the same command again replays nothing."""
    db = own_database
    lead = add_key(db, "lead", "failed_final")
    lead_dl = add_dead_letter(db, lead)
    bad = add_key(db, "bad", "quarantined", event_type="crm.lead.updated")
    bad_dl = add_dead_letter(db, bad, "quarantined")
    add_key(db, "done", "succeeded")
    add_key(db, "busy", "processing", lease="5 minutes")
    other_dl = add_dead_letter(db, add_key(db, "ping", "failed_final", event_type="plain.ping"))

    report = ok_json(idem("replay", "--event-type", "crm.*", "--json"))
    assert (report["dry_run"], report["matched"], report["to_replay"]) == (True, 4, 2)
    assert sorted(report["keys"]) == sorted([mask_key(lead), mask_key(bad)])
    assert sorted(s["reason"] for s in report["skipped"]) == [
        "already succeeded",
        "in flight (lease live)",
    ]
    assert report["by_event_type"] == {"crm.lead.created": 1, "crm.lead.updated": 1}
    [(target, replayed)] = report["by_target"].items()
    assert target.startswith("http 127.0.0.1:") and replayed == 2
    command = f"idem replay --event-type 'crm.*' --limit 100 --confirm {report['confirm']}"
    assert report["command"] == command
    text = idem("replay", "--event-type", "crm.*")
    assert text.returncode == 0, text.stderr
    # Each dry run signs its own time, so the text run's token is its own.
    assert "matched 4: 2 to replay, 2 skipped" in text.stdout
    assert "idem replay --event-type 'crm.*' --limit 100 --confirm rp3_" in text.stdout
    assert "already succeeded" in text.stdout and "crm.lead.updated" in text.stdout
    assert count(db, "SELECT count(*) FROM outbox") == 0
    assert count(db, "SELECT count(*) FROM dead_letters WHERE resolution = 'open'") == 3

    executed = ok_json(idem(*shlex.split(command)[1:], "--by", "alice", "--json"))
    assert executed["dry_run"] is False and executed["to_replay"] == 2
    assert query(
        db,
        "SELECT idempotency_key, status, attempts FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%s) ORDER BY 1",
        ([lead, bad],),
    ) == sorted([(lead, "pending", 0), (bad, "pending", 0)])
    assert query(db, "SELECT idempotency_key, count(*) FROM outbox GROUP BY 1 ORDER BY 1") == (
        sorted([(lead, 1), (bad, 1)])
    )
    assert query(db, "SELECT id, resolution, resolved_by FROM dead_letters ORDER BY id") == [
        (lead_dl, "replayed", "alice"),
        (bad_dl, "replayed", "alice"),
        (other_dl, "open", None),
    ]
    assert query(db, "SELECT id, requested_by, filter, key_count, keys FROM replays") == [
        (
            executed["replay_id"],
            "alice",
            {"event_type": "crm.*", "limit": 100},
            2,
            sorted([lead, bad]),
        )
    ]

    again = idem(*shlex.split(command)[1:], "--json")
    assert again.returncode == 1
    assert "the set changed; nothing replayed" in again.stderr
    assert json.loads(again.stdout)["to_replay"] == 0
    assert count(db, "SELECT count(*) FROM outbox") == 2
    assert count(db, "SELECT count(*) FROM replays") == 1
    fresh = idem("replay", "--event-type", "crm.*", "--dry-run")
    assert fresh.returncode == 0 and "nothing to replay" in fresh.stdout


def test_replay_with_a_stale_token_exits_1_and_changes_nothing(
    own_database: str, idem: Idem
) -> None:
    """When the selected set changed since the dry run, --confirm exits 1 with the fresh report
    and replays nothing."""
    db = own_database
    first = add_key(db, "first", "failed_final")
    add_dead_letter(db, first)
    token = ok_json(idem("replay", "--status", "failed_final", "--json"))["confirm"]
    add_dead_letter(db, add_key(db, "second", "failed_final"))
    stale = idem("replay", "--status", "failed_final", "--confirm", token, "--json")
    assert stale.returncode == 1
    assert "idem: the set changed; nothing replayed" in stale.stderr
    fresh = json.loads(stale.stdout)
    assert fresh["stale"] is True and fresh["to_replay"] == 2 and fresh["confirm"] != token
    assert fresh["command"].endswith(f"--confirm {fresh['confirm']}")
    text = idem("replay", "--status", "failed_final", "--confirm", token)
    assert text.returncode == 1 and "matched 2: 2 to replay" in text.stdout
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'failed_final'") == 2
    assert count(db, "SELECT count(*) FROM outbox") == 0
    assert count(db, "SELECT count(*) FROM replays") == 0
    assert count(db, "SELECT count(*) FROM dead_letters WHERE resolution = 'open'") == 2


FIRST_SECRET = "first-replay-secret-0123456789abcdef"
SECOND_SECRET = "second-replay-secret-0123456789abcdef"


def test_the_confirm_token_is_signed_with_the_configured_secret(
    own_database: str, idem: Idem
) -> None:
    """Dry run and execution are separate processes: a token from a dry run under another
    REPLAY_SECRET is refused (exit 1, nothing replayed); under the same secret it replays."""
    db = own_database
    add_dead_letter(db, add_key(db, "lead", "failed_final"))
    dry = ok_json(idem("replay", "--status", "failed_final", "--json", REPLAY_SECRET=FIRST_SECRET))
    other = idem(
        "replay",
        "--status",
        "failed_final",
        "--confirm",
        dry["confirm"],
        REPLAY_SECRET=SECOND_SECRET,
    )
    assert other.returncode == 1 and "the set changed; nothing replayed" in other.stderr
    assert count(db, "SELECT count(*) FROM replays") == 0
    assert count(db, "SELECT count(*) FROM outbox") == 0
    same = idem(
        "replay",
        "--status",
        "failed_final",
        "--confirm",
        dry["confirm"],
        REPLAY_SECRET=FIRST_SECRET,
    )
    assert same.returncode == 0, same.stderr
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'pending'") == 1
    assert count(db, "SELECT count(*) FROM replays") == 1


def test_replay_without_a_filter_is_refused(own_database: str, idem: Idem) -> None:
    """A replay naming no status, event type, window or key exits 2 with the model's message,
    as do an unknown status and --dry-run with --confirm; nothing is written."""
    add_dead_letter(own_database, add_key(own_database, "lead", "failed_final"))
    for args in (
        ("replay",),
        ("replay", "--limit", "5", "--confirm", "rp1_0000"),
        ("replay", "--source", "webform"),
    ):
        refused = idem(*args)
        assert refused.returncode == 2, args
        assert refused.stderr.startswith("idem: a replay filter must name statuses"), args
    unknown = idem("replay", "--status", "succeeded")
    assert unknown.returncode == 2 and unknown.stderr.startswith("idem: statuses.0:")
    assert idem("replay", "--status", "failed_final", "--dry-run", "--confirm", "x").returncode == 2
    assert idem("replay", "--since", "last week").returncode == 2
    assert count(own_database, "SELECT count(*) FROM replays") == 0
    assert count(own_database, "SELECT count(*) FROM outbox") == 0


def test_stuck_exits_1_only_when_a_key_is_stuck(own_database: str, idem: Idem) -> None:
    """`stuck` exits 0 while keys are fresh and 1 once a processing key is untouched past the
    threshold, listing only that key."""
    db = own_database
    add_key(db, "fresh", "processing", age="10 seconds", lease="20 seconds")
    add_key(db, "old-but-done", "succeeded", age="2 days")
    calm = idem("stuck", "--older-than", "5m")
    assert calm.returncode == 0, calm.stderr
    assert "no keys stuck longer than 5m" in calm.stdout
    assert json.loads(idem("stuck", "--older-than", "5m", "--json").stdout) == {
        "keys": [],
        "blocked_lanes": [],
    }
    old = add_key(db, "old", "processing", age="1 hour", lease="-59 minutes")
    alert = idem("stuck", "--older-than", "5m", "--json")
    assert alert.returncode == 1, alert.stderr
    [row] = json.loads(alert.stdout)["keys"]
    assert (row["key"], row["status"], row["event_type"]) == (
        mask_key(old),
        "processing",
        "crm.lead.created",
    )
    assert 3500 < row["age_seconds"] < 4000
    table = idem("stuck", "--older-than", "5m")
    assert table.returncode == 1 and mask_key(old) in table.stdout
    assert idem("stuck", "--older-than", "2h").returncode == 0
    bad = idem("stuck", "--older-than", "soon")
    assert bad.returncode == 2 and bad.stderr.startswith("idem: --older-than:")


def test_stuck_shows_a_blocked_lane_once_with_its_head(own_database: str, idem: Idem) -> None:
    """A lane whose head has an open dead letter is listed once with its head (masked), the
    head's error and the keys parked behind it, which are not listed as stuck keys; a `skip`
    lane's parked key is; discarding the head's dead letter hands the lane on."""
    db = own_database
    seed_lane_key(db, "c7-v0", "succeeded", lane="contact-7", rank=1)
    head = seed_lane_key(
        db, "c7-v1", "failed_final", lane="contact-7", rank=2, error_code="http_422", age="2 hours"
    )
    behind = [
        seed_lane_key(
            db, f"c7-v{n}", "pending", lane="contact-7", rank=n, error_code="lane_waiting"
        )
        for n in (3, 4)
    ]
    # Parked behind a key still on its way: not blocked (the head will run).
    seed_lane_key(db, "c8-v1", "failed_retryable", lane="contact-8", rank=1, age="1 minute")
    query(
        db,
        "UPDATE idempotency_keys SET next_attempt_at = now() + interval '1 hour'"
        " WHERE status = 'failed_retryable'",
    )
    waits_for_retry = seed_lane_key(
        db, "c8-v2", "pending", lane="contact-8", rank=2, error_code="lane_waiting"
    )
    # A lane that goes on past its dead letters: a key parked there this long is stuck.
    seed_lane_key(
        db, "c9-v1", "failed_final", lane="contact-9", rank=1, on_failure="skip", error_code="x"
    )
    parked_in_skip = seed_lane_key(
        db, "c9-v2", "pending", lane="contact-9", rank=2, error_code="lane_waiting"
    )
    (dead_letter,) = query(db, "SELECT id FROM dead_letters WHERE idempotency_key = %s", (head,))[0]

    found = idem("stuck", "--older-than", "5m", "--json")
    assert found.returncode == 1, found.stderr
    doc = json.loads(found.stdout)
    # Parked an hour: behind a skip lane's dead letter, or behind a retry an hour away.
    stuck_keys = {row["key"] for row in doc["keys"]}
    assert stuck_keys == {mask_key(parked_in_skip), mask_key(waits_for_retry)}
    [lane] = doc["blocked_lanes"]
    assert {
        k: lane[k] for k in ("route", "lane", "head_key", "head_status", "head_error_code")
    } == {
        "route": "crm",
        "lane": "contact-7",
        "head_key": mask_key(head),
        "head_status": "failed_final",
        "head_error_code": "http_422",
    }
    assert (lane["waiting"], lane["dead_letter_id"]) == (2, dead_letter)
    assert 7100 < lane["blocked_seconds"] < 7400
    table = idem("stuck", "--older-than", "5m")
    assert table.returncode == 1
    assert "blocked lanes" in table.stdout and mask_key(head) in table.stdout
    assert head not in table.stdout and "contact-7" in table.stdout
    # Not blocked for that long yet (its keys wait since an hour ago).
    later = ok_json(idem("stuck", "--older-than", "2h", "--json"))
    assert later == {"keys": [], "blocked_lanes": []}

    assert idem("dlq", "discard", str(dead_letter), "--reason", "sent by hand").returncode == 0
    released = json.loads(idem("stuck", "--older-than", "5m", "--json").stdout)
    assert released["blocked_lanes"] == []
    # The lane went on: its next key is queued, the one after it waits its turn (since an
    # hour ago, so it shows as stuck until the lane reaches it).
    assert query(db, "SELECT idempotency_key FROM outbox") == [(behind[0],)]
    assert {row["key"] for row in released["keys"]} == stuck_keys | {mask_key(behind[1])}


def test_dlq_list_filters_superseded_dead_letters(own_database: str, idem: Idem) -> None:
    """A dead letter closed by a newer version of its lane lists under `--status superseded`."""
    db = own_database
    old = add_dead_letter(db, add_key(db, "old", "superseded"), resolution="superseded")
    add_dead_letter(db, add_key(db, "other", "failed_final"))
    listed = ok_json(idem("dlq", "list", "--status", "superseded", "--json"))["items"]
    assert [(i["id"], i["status"]) for i in listed] == [(old, "superseded")]


def test_purge_dry_run_counts_and_yes_removes_only_what_may_go(
    own_database: str, idem: Idem
) -> None:
    """`purge --dry-run` counts and changes nothing; `purge --yes` removes expired keys and old
    published outbox rows, never a processing key or one with an open dead letter; neither
    flag is refused."""
    db = own_database
    gone = add_key(db, "gone", "succeeded", expires_in="-1 day")
    gone_too = add_key(db, "gone-too", "failed_final", expires_in="-1 day")
    add_dead_letter(db, gone_too, resolution="discarded")
    busy = add_key(db, "busy", "processing", expires_in="-1 day")
    held = add_key(db, "held", "failed_final", expires_in="-1 day")
    add_dead_letter(db, held)
    fresh = add_key(db, "fresh", "succeeded")
    add_outbox(db, fresh, published_ago="30 days")
    add_outbox(db, fresh, published_ago="1 hour")
    add_outbox(db, fresh)

    for args in (("purge",), ("purge", "--dry-run", "--yes")):
        refused = idem(*args)
        assert refused.returncode == 2 and refused.stderr.startswith("idem: "), args
    assert "idem purge --dry-run" in idem("purge").stderr
    counted = ok_json(idem("purge", "--dry-run", "--json"))
    assert counted["dry_run"] is True
    assert (counted["expired_keys"], counted["published_outbox_rows"]) == (2, 1)
    assert "would remove 2 expired keys" in idem("purge", "--dry-run").stdout
    assert count(db, "SELECT count(*) FROM idempotency_keys") == 5
    assert count(db, "SELECT count(*) FROM outbox") == 3

    purged = ok_json(idem("purge", "--yes", "--batch", "1", "--json"))
    assert purged["dry_run"] is False
    assert (purged["expired_keys"], purged["published_outbox_rows"]) == (2, 1)
    left = {k for (k,) in query(db, "SELECT idempotency_key FROM idempotency_keys")}
    assert left == {busy, held, fresh}
    assert gone not in {k for (k,) in query(db, "SELECT idempotency_key FROM events")}
    assert (
        count(db, "SELECT count(*) FROM dead_letters WHERE idempotency_key = %s", (gone_too,)) == 0
    )
    assert count(db, "SELECT count(*) FROM dead_letters") == 1
    assert count(db, "SELECT count(*) FROM outbox") == 2
    assert "removed 0 expired keys" in idem("purge", "--yes").stdout


def test_stats_json_matches_the_rows(own_database: str, idem: Idem) -> None:
    """`stats --json` counts keys by status, the outbox backlog and lag, processing keys, open
    dead letters, duplicates blocked and leases reclaimed exactly as the rows say."""
    db = own_database
    waiting = add_key(db, "p1", "pending", duplicates=2)
    add_outbox(db, waiting, available_in="-10 minutes")
    later = add_key(db, "p2", "pending")
    add_outbox(db, later, available_in="1 hour")
    add_outbox(db, later, published_ago="1 minute")
    add_key(db, "r1", "processing", age="1 hour", lease="-30 minutes", reclaimed=1)
    add_key(db, "r2", "processing", age="5 seconds", lease="25 seconds", reclaimed=2)
    add_key(db, "s1", "succeeded", duplicates=3, blocked=2)
    add_key(db, "s2", "succeeded", blocked=1)
    add_dead_letter(db, add_key(db, "f1", "failed_final"))
    add_dead_letter(db, add_key(db, "f2", "failed_final"), resolution="discarded")
    add_dead_letter(db, add_key(db, "q1", "quarantined"), "quarantined")
    for version in ("1", "2"):
        seed_lane_key(db, f"v{version}", "superseded", lane="c-1", rank=1, superseded_by="3")

    doc = ok_json(idem("stats", "--json"))
    assert doc["keys_by_status"] == {
        "pending": 2,
        "processing": 2,
        "succeeded": 2,
        "failed_retryable": 0,
        "failed_final": 2,
        "quarantined": 1,
        "superseded": 2,
        "fanned_out": 0,
    }
    assert (doc["outbox"]["due"], doc["outbox"]["unpublished"]) == (1, 2)
    assert 590 < doc["outbox"]["oldest_due_age_seconds"] < 700
    assert doc["outbox"]["relay_lead"] is None  # no relay runs here
    assert (doc["processing"]["count"], doc["processing"]["lease_expired"]) == (2, 1)
    assert 3590 < doc["processing"]["oldest_age_seconds"] < 3700
    assert doc["open_dead_letters"] == {"permanent": 1, "retries_exhausted": 0, "quarantined": 1}
    assert doc["duplicates_blocked"] == {"receiver": 5, "worker": 3, "claims": 0}
    assert doc["leases_reclaimed"] == 3
    text = idem("stats")
    assert text.returncode == 0, text.stderr
    for label in ("keys by status", "superseded", "open dead letters", "leases reclaimed"):
        assert label in text.stdout


def test_routes_pause_resume_and_stuck_say_what_waits(idem: Idem, own_database: str) -> None:
    """`idem routes pause` holds a route on record, `idem routes` shows it paused with its
    backlog, `idem stuck` does not count its keys but says how many wait there, and
    `idem routes resume` queues them."""
    key = seed_pending_key(own_database, "held-1")
    # As the worker's DEFER leaves a key the pause held: pending, `route_paused`, no delivery.
    query(
        own_database,
        "UPDATE idempotency_keys SET updated_at = now() - interval '1 hour',"
        " error_code = 'route_paused'",
    )
    assert idem("routes", "pause", "nope", "--reason", "x").returncode == 2
    paused = ok_json(idem("routes", "pause", "crm", "--reason", "CRM upgrade", "--json"))
    assert paused == {"name": "crm", "paused": True, "changed": True}
    listed = {r["name"]: r for r in ok_json(idem("routes", "--json"))}
    assert (listed["crm"]["state"], listed["crm"]["backlog"]) == ("paused", 1)
    assert listed["crm"]["paused_by"] == "tester"
    stuck = idem("stuck", "--older-than", "1m", "--json")
    assert stuck.returncode == 0 and json.loads(stuck.stdout) == {"keys": [], "blocked_lanes": []}
    assert "1 keys wait on paused or open routes (crm 1)" in stuck.stderr
    stats = ok_json(idem("stats", "--json"))
    assert stats["routes"] == {"crm": {"state": "paused", "backlog": 1, "probe_in_seconds": 0.0}}
    resumed = ok_json(idem("routes", "resume", "crm", "--json"))
    assert resumed == {"name": "crm", "paused": False, "changed": True, "queued": 1}
    assert query(own_database, "SELECT idempotency_key FROM outbox") == [(key,)]
    # Queued by the resume just now: no longer held by the route, and not stuck.
    after = idem("stuck", "--older-than", "1m")
    assert after.returncode == 0 and "paused or open routes" not in after.stderr


# A `fail` detail as a claims-token holder could write it: an OSC 8 link, a screen clear, a
# colour, a carriage return that rewrites the line, a C1 CSI and a bidirectional override.
HOSTILE = (
    "\x1b]8;;https://evil.example\x1b\\Re-authenticate\x1b]8;;\x1b\\ \x1b[2J\x1b[31mred"
    "\rfake line \x9b31m \u202eevil"
)


def test_show_and_dlq_show_print_what_senders_wrote_with_its_controls_escaped(
    own_database: str, idem: Idem
) -> None:
    """`idem show` and `idem dlq show` (tables, the payload, `--json`) print no escape
    sequence, carriage return, C1 control or bidirectional override a sender or a workflow
    wrote: each is shown as its escape, and `--json` stays JSON that reads back the same."""
    db = own_database
    key = add_key(db, "eve", "failed_final", payload={"note": HOSTILE})
    dead = add_dead_letter(db, key)
    query(db, "UPDATE dead_letters SET error_detail = %s WHERE id = %s", (HOSTILE, dead))
    query(
        db,
        "INSERT INTO attempts (idempotency_key, attempt, started_at, outcome, error_code, detail)"
        " VALUES (%s, 1, now(), 'failed', 'workflow_failed', %s)",
        (key, HOSTILE),
    )
    for args in (("show", key), ("dlq", "show", str(dead))):
        for extra in ((), ("--json",)):
            shown = idem(*args, *extra)
            assert shown.returncode == 0, shown.stderr
            for raw in ("\x1b", "\r", "\x9b", "\u202e"):
                assert raw not in shown.stdout, (args, extra, raw)
            assert "Re-authenticate" in shown.stdout
            if not extra:
                assert "\\x1b]8;;https://evil.example" in shown.stdout
    found = ok_json(idem("dlq", "show", str(dead), "--json"))
    assert found["payload"]["note"] == HOSTILE
