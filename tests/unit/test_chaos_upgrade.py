"""Unit tests for the upgrade soak's parts: the previous release it starts from, each process
run on its version's code and checked for it, traffic without late writes, and the answers
intake may give."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.chaos import plan
from tests.chaos.check import Violations
from tests.chaos.client import Answer, Sender
from tests.chaos.crm import FakeCrm
from tests.chaos.upgrade import intake_answers
from tests.chaos.upgrade_fleet import (
    NEW,
    OLD,
    PREVIOUS_COMMIT,
    PREVIOUS_SCHEMA,
    VersionedFleet,
)
from tests.support import ROOT

SEED = 5151


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def test_the_previous_release_is_a_commit_of_this_history_at_its_schema() -> None:
    """The recorded commit is in the repository's history, an ancestor of this checkout, and
    its migrations end at PREVIOUS_SCHEMA (0.4.0's 0016 to 0019 came after it)."""
    assert _git("cat-file", "-t", PREVIOUS_COMMIT).strip() == "commit"
    subprocess.run(
        ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", PREVIOUS_COMMIT, "HEAD"],
        check=True,
    )
    files = _git("ls-tree", "--name-only", PREVIOUS_COMMIT, "migrations/versions/").split()
    revisions = sorted(Path(name).name.split("_", 1)[0] for name in files if name.endswith(".py"))
    assert revisions[-1] == PREVIOUS_SCHEMA


def test_each_role_runs_its_version_s_code(tmp_path: Path) -> None:
    """A role not upgraded yet starts on the previous release's folder (working directory and
    PYTHONPATH, through the line that names its packages), an upgraded one on this
    checkout's."""
    old = tmp_path / "previous"
    fleet = VersionedFleet({}, tmp_path, tmp_path, trees={OLD: old, NEW: ROOT})
    argv, cwd, env = fleet.command("worker", ["-m", "worker", "--concurrency", "2"])
    assert (argv[1], argv[3:], cwd, env) == (
        "-c",
        ["worker", "--concurrency", "2"],
        old,
        {"PYTHONPATH": str(old)},
    )
    fleet.running["worker"] = NEW
    _, cwd, env = fleet.command("worker", ["-m", "worker"])
    assert (cwd, env) == (ROOT, {"PYTHONPATH": str(ROOT)})


def test_a_process_on_the_wrong_code_is_named(tmp_path: Path) -> None:
    """A process whose packages came from another folder than its version's, or that never
    said where they came from, is a problem; one on its own code is not."""
    old = tmp_path / "previous"
    fleet = VersionedFleet({}, tmp_path, tmp_path, trees={OLD: old, NEW: ROOT})
    lines = {
        "relay-1": (OLD, old),
        "relay-2": (NEW, ROOT),
        "worker-1": (NEW, old),
    }
    for name, (version, tree) in lines.items():
        fleet.version_of[name] = version
        line = {"event": "upgrade.code"} | {
            package: str(tree / package / "__init__.py") for package in ("outbox", "worker")
        }
        (tmp_path / f"{name}.log").write_text(json.dumps(line) + "\n{}\n")
    fleet.version_of["sweeper-1"] = OLD
    (tmp_path / "sweeper-1.log").write_text("{}\n")
    problems = fleet.code_problems()
    assert [p.split(":")[0] for p in problems] == [
        "worker-1 (new)",
        "worker-1 (new)",
        "sweeper-1 (old)",
    ]


def test_without_late_writes_no_key_is_applied_late_and_the_crm_agrees() -> None:
    """The same plan without late writes gives no event, delivery or claims key that
    behaviour; a key that would be applied late is written and answered at once by a CRM
    told so, and the claims still cover every other path."""
    late_events, _ = plan.plan_events(SEED, 300, 60.0)
    events, _ = plan.plan_events(SEED, 300, 60.0, late=False)
    kinds = [e.behaviour.kind for e in events]
    kinds += [b.kind for e in events for b in e.destinations.values()]
    assert plan.APPLIED_LATE not in kinds
    late = next(
        e
        for e in late_events
        if e.behaviour.kind == plan.APPLIED_LATE and e.event_type in plan.COLLECTIONS
    )
    collection = plan.COLLECTIONS[late.event_type]
    status, _, commit, delay, unanswered = FakeCrm(SEED)._reply(late.key, collection)
    assert (status, commit, unanswered) == (201, True, True) and delay >= 1.5
    assert FakeCrm(SEED, late=False)._reply(late.key, collection) == (201, {}, True, 0.0, False)
    claims = {e.behaviour.kind for e in events if e.via == plan.VIA_CLAIMS}
    assert claims >= set(plan.CLAIMS_COVERAGE) - {plan.APPLIED_LATE}


def test_intake_may_answer_202_200_503_with_retry_after_or_a_conflict_s_422() -> None:
    """Those answers pass; a 500, a 503 without Retry-After, a 422 to a delivery that is no
    conflict, and no answer at all are each a violation."""
    sender = Sender("http://127.0.0.1:9", [])
    fine = [
        Answer(1, plan.FIRST, 0.0, 0.1, 202),
        Answer(1, plan.SOON, 0.0, 0.1, 200),
        Answer(2, plan.FIRST, 0.0, 0.1, 503, retry_after="1"),
        Answer(3, plan.CONFLICT, 0.0, 0.1, 422),
    ]
    wrong = [
        Answer(4, plan.FIRST, 0.0, 0.1, 500),
        Answer(5, plan.FIRST, 0.0, 0.1, 503),
        Answer(6, plan.FIRST, 0.0, 0.1, 422),
        Answer(7, plan.FIRST, 0.0, 0.1, None, error="ConnectError"),
    ]
    sender.answers = fine + wrong
    violations = Violations()
    intake_answers(sender, violations)
    assert violations.counts == {"intake_answer": len(wrong)}
