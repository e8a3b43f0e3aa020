"""`idem demo`: the story that started this product, told against real processes.

A lead arrives from a web form; the CRM creates the follow-up task but its answer is lost; the
gateway marks the attempt uncertain, asks the CRM by the event's key, finds the task and records
it; the form provider redelivers the event and gets the stored answer. The CRM ends with one
task. The CRM is `examples.fake_crm.FakeCrm`; the gateway is started the way `idem dev` starts
it (embedded PostgreSQL and Redis in a temporary folder unless DATABASE_URL / BROKER_URL are set;
receiver, relay, worker and sweeper as subprocesses). Everything started is stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from examples.fake_crm import FakeCrm
from outbox.store import embedded
from outbox.store.embedded import start_postgres, start_redis
from outbox.store.migrate import upgrade
from outbox.store.ports import free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
EVENT_TYPE = "crm.followup.requested"
TERMINAL = {"succeeded", "failed_final", "quarantined"}
AHEAD = {"pending", "processing"}  # the first attempt has not finished

ROUTES = """[[routes]]
match = "crm.followup.*"
name = "crm-followups"
action = "http"
url = "{crm}/api/tasks"
external_ref_pointer = "/id"
reconcile_url = "{crm}/api/tasks/by-key/{{key}}"
connect_timeout_seconds = 1
read_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 1
"""


def say(text: str) -> None:
    print(text, flush=True)


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `condition` until it returns something truthy; raise naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)
    return value


class Watcher(threading.Thread):
    """Polls GET /v1/events/{key} every 10 ms until the key is finished, keeping each state
    whose (status, error_code) differs from the one before."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.seen: list[dict[str, Any]] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while not self.seen or self.seen[-1]["status"] not in TERMINAL:
                try:
                    state = client.get(f"/v1/events/{self.key}").json()
                except httpx.HTTPError:
                    return  # the gateway is gone: the story has failed already
                last = self.seen[-1] if self.seen else {"status": None, "error_code": None}
                if (state["status"], state["error_code"]) != (last["status"], last["error_code"]):
                    self.seen.append(state)
                time.sleep(0.01)

    def trail(self) -> str:
        return " -> ".join(
            s["status"] + (f" ({s['error_code']})" if s["error_code"] else "") for s in self.seen
        )


def start_gateway(
    work: Path, crm_url: str, servers: list[Any], children: list[subprocess.Popen[bytes]]
) -> str:
    """Servers (embedded unless given), migrations, then the four processes logging to
    `work/logs`; returns the receiver's URL. What it starts is added to `servers`/`children`."""
    env = dict(os.environ)
    if not env.get("DATABASE_URL"):
        server, env["DATABASE_URL"] = start_postgres(work / "postgres")
        servers.append(server)
    if not env.get("BROKER_URL") and not env.get("REDIS_URL"):
        redis, env["REDIS_URL"] = start_redis(work / "redis", appendonly=False)
        servers.append(redis)
    upgrade(env["DATABASE_URL"])
    routes = work / "routes.toml"
    routes.write_text(ROUTES.format(crm=crm_url), encoding="utf-8")
    port, metrics_port = free_port(), free_port()
    env.update(
        ROUTES_FILE=str(routes),
        PORT=str(port),
        WORKER_METRICS_PORT=str(metrics_port),
        LEASE_SECONDS="5",
        SWEEP_GRACE_SECONDS="2",
        LOG_FORMAT="json",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    commands = {
        "receiver": ["-m", "outbox.cli", "serve", "--port", str(port)],
        "relay": ["-m", "outbox.cli", "relay"],
        "worker": ["-m", "worker", "--concurrency", "2"],
        "sweeper": ["-m", "outbox.cli", "sweep"],
    }
    for name, args in commands.items():
        with (work / "logs" / f"{name}.log").open("wb") as log:
            children.append(
                subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=log)
            )
    wait_for_port(port, children[0], timeout=30)
    # The worker opens its metrics port just before it starts consuming.
    wait_for_port(metrics_port, children[2], timeout=60)
    return f"http://127.0.0.1:{port}"


def stop_all(servers: list[Any], children: list[subprocess.Popen[bytes]]) -> None:
    """The gateway's processes together (SIGTERM, SIGKILL after 10 s), then Redis, PostgreSQL."""
    for group in (children, [s for s in servers if isinstance(s, subprocess.Popen)]):
        embedded.terminate(group)
    for server in servers:
        if not isinstance(server, subprocess.Popen):
            server.cleanup()


def tell_story(gateway: str, crm: FakeCrm) -> bool:
    """Steps 1 to 6; returns whether the story ended as it should."""
    envelope = {
        "source": "webform",
        "event_type": EVENT_TYPE,
        "external_id": f"form-{uuid.uuid4().hex[:8]}",
        "payload": {"customer": "Ada Lovelace", "email": "ada@example.com", "assignee": "Sales"},
    }
    crm.lose_next_response()
    with httpx.Client(base_url=gateway, timeout=10) as client:
        say("\n1) A lead arrives from a web form.")
        first = client.post("/v1/events", json=envelope).raise_for_status()
        key, correlation_id = first.json()["key"], first.json()["correlation_id"]
        watcher = Watcher(gateway, key)
        watcher.start()
        say(f"   POST /v1/events {EVENT_TYPE}: follow up with Ada Lovelace, assignee Sales")
        say(f"   -> {first.status_code} {first.json()['status']}, key {key}")

        say("\n2) The CRM creates the follow-up task, and its answer is lost on the way back.")
        task = wait_for(lambda: crm.lost and crm.task_for(key), "the CRM's create")
        say(f"   The CRM committed {task['id']} for {task['assignee']} and dropped the connection")
        say("   without answering: the gateway cannot tell whether the task exists.")

        say("\n3) The attempt is marked uncertain.")
        wait_for(lambda: any(s["status"] not in AHEAD for s in watcher.seen), "a failed attempt")
        failed = next((s for s in watcher.seen if s["status"] == "failed_retryable"), None)
        if failed is not None:
            say(f"   GET /v1/events/{{key}} -> {failed['status']}, {failed['error_code']}")
            say("   The answer was lost, not refused: the next attempt must look before it acts.")
        else:
            say(f"   The retry was quicker than the poll; the API showed: {watcher.trail()}")

        say("\n4) The recovery step asks the CRM by the event key and finds the existing task.")
        wait_for(lambda: not watcher.is_alive(), "the end of the event", timeout=60)
        state = client.get(f"/v1/events/{key}").json()
        result = state["result"] or {}
        posts = "no second POST" if len(crm.tasks) == 1 else f"{len(crm.tasks)} POSTs in all"
        say(f"   GET /api/tasks/by-key/{{key}} asked {crm.lookups.count(key)} time(s), {posts}.")
        say(f"   Statuses seen through the API: {watcher.trail()}")
        outcome = f"{state['status']} after {state['attempts']} attempts"
        reconciled, ref = json.dumps(result.get("reconciled")), state["external_ref"]
        say(f"   -> {outcome}, reconciled={reconciled}, external_ref {ref}")

        say("\n5) The form provider redelivers the original event.")
        again = client.post("/v1/events", json=envelope)
        body = again.json()
        replayed = again.headers.get("Idempotent-Replayed")
        same = "the original" if body["correlation_id"] == correlation_id else "NOT the original"
        say("   POST /v1/events with the same envelope")
        say(
            f"   -> {again.status_code} duplicate={json.dumps(body['duplicate'])}, "
            f"Idempotent-Replayed: {replayed}, external_ref {body.get('external_ref')}"
        )
        say(f"   correlation_id {body['correlation_id']} ({same})")

    say("\n6) The end.")
    tasks = httpx.get(f"{crm.url}/api/tasks", timeout=5).json()
    say("   GET /api/tasks on the CRM:")
    for task in tasks:
        say(f"   {task['id']}: {task['title']!r}, assigned to {task['assignee']}")
    say(f"side effects: {len(tasks)} task{'' if len(tasks) == 1 else 's'}")
    return (
        len(tasks) == 1
        and tasks[0]["assignee"] == "Sales"
        and state["status"] == "succeeded"
        and state["external_ref"] == tasks[0]["id"]
        and again.status_code == 200
        and replayed == "true"
        and body["external_ref"] == tasks[0]["id"]
        and body["correlation_id"] == correlation_id
    )


def show_logs(logs: Path, lines: int = 15) -> None:
    """The last lines of each process's log, on stderr, when the story failed."""
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.name} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr)


def main() -> int:
    """Run the story; 0 when it ended with exactly one task and the expected answers, else 1."""
    work = Path(tempfile.mkdtemp(prefix="idem-demo-"))
    crm = FakeCrm()
    servers: list[Any] = []
    children: list[subprocess.Popen[bytes]] = []
    (work / "logs").mkdir()
    ok = False
    try:
        crm_url = crm.start()
        say("idem demo: one lead, a lost answer, a redelivery, and still one follow-up task.")
        say(f"Starting a fake CRM at {crm_url} and the gateway in {work} ...")
        gateway = start_gateway(work, crm_url, servers, children)
        say(f"The gateway listens at {gateway}.")
        ok = tell_story(gateway, crm)
        if not ok:
            say("The story did not end as it should (see above).")
    except Exception:
        traceback.print_exc()
    finally:
        if not ok:
            show_logs(work / "logs")
        stop_all(servers, children)
        crm.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
