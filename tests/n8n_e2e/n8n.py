"""A real n8n 2.8.4 for the end-to-end check: install it, import and publish workflows, run it.

The pin (package.json + package-lock.json in `pin/`) is n8n 2.8.4, the newest release whose
engines allow Node 20. It is installed with `npm ci --omit=dev` into `.n8n/` at the project
root (git-ignored, about 2.3 GB, about 5 minutes), unless `N8N_BIN` names an n8n executable.

n8n runs loopback-only on port 5679 with its own sqlite home in a temporary folder; nothing of
a user's n8n (`~/.n8n`) is read or written.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import sqlite3
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from outbox.store.embedded import terminate
from outbox.store.ports import port_free
from tests.support import ROOT

PIN = Path(__file__).resolve().parent / "pin"
INSTALL_DIR = ROOT / ".n8n"
VERSION = "2.8.4"
PORT = 5679
# n8n 2.x puts its task-runner broker on 5679 too; moved so it does not clash with PORT.
BROKER_PORT = 5681
# A cold n8n start (migrations of a fresh sqlite, loading every node package) takes 20-60 s
# on a 2-core machine; the limit only ends a start that hangs.
START_TIMEOUT_SECONDS = 180.0
ACTIVATED = "Editor is now accessible via"

# Loopback only, sqlite, nothing phoned home: the settings of the shared n8n.env.example.
BASE_ENV = {
    "N8N_HOST": "127.0.0.1",
    "N8N_LISTEN_ADDRESS": "127.0.0.1",
    "N8N_PORT": str(PORT),
    "N8N_PROTOCOL": "http",
    "WEBHOOK_URL": f"http://127.0.0.1:{PORT}/",
    "N8N_RUNNERS_BROKER_PORT": str(BROKER_PORT),
    "N8N_RUNNERS_BROKER_LISTEN_ADDRESS": "127.0.0.1",
    "N8N_DIAGNOSTICS_ENABLED": "false",
    "N8N_DIAGNOSTICS_CONFIG_FRONTEND": "",
    "N8N_DIAGNOSTICS_CONFIG_BACKEND": "",
    "EXTERNAL_FRONTEND_HOOKS_URLS": "",
    "N8N_VERSION_NOTIFICATIONS_ENABLED": "false",
    "N8N_VERSION_NOTIFICATIONS_WHATS_NEW_ENABLED": "false",
    "N8N_TEMPLATES_ENABLED": "false",
    "N8N_PERSONALIZATION_ENABLED": "false",
    "N8N_DYNAMIC_BANNERS_ENABLED": "false",
    "N8N_HIRING_BANNER_ENABLED": "false",
    "N8N_AI_ENABLED": "false",
    "DB_TYPE": "sqlite",
    "N8N_SECURE_COOKIE": "false",
    "N8N_ENFORCE_SETTINGS_FILE_PERMISSIONS": "true",
    "N8N_LOG_LEVEL": "info",
}


class N8nUnavailable(RuntimeError):
    """n8n is not installed (and may not be installed here), or it did not start."""


def installed_binary() -> Path | None:
    """The n8n to use: `N8N_BIN`, else the project's own install of the pin, else None."""
    if given := os.environ.get("N8N_BIN"):
        path = Path(given)
        return path if path.exists() else None
    binary = INSTALL_DIR / "node_modules" / ".bin" / "n8n"
    if binary.exists() and filecmp.cmp(
        PIN / "package-lock.json", INSTALL_DIR / "package-lock.json", shallow=False
    ):
        return binary
    return None


def install() -> Path:
    """Install the pinned n8n into `.n8n/` with `npm ci --omit=dev` (reused while the pin holds)."""
    if found := installed_binary():
        return found
    if os.environ.get("N8N_BIN"):
        raise N8nUnavailable(f"N8N_BIN={os.environ['N8N_BIN']} does not exist")
    if shutil.which("npm") is None:
        raise N8nUnavailable("npm is not on PATH: install Node 20 (with npm) first")
    INSTALL_DIR.mkdir(exist_ok=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(PIN / name, INSTALL_DIR / name)
    env = dict(os.environ)
    # sqlite3 is built from source; node-gyp must find Node's headers locally.
    env.setdefault("npm_config_nodedir", "/usr")
    print(f"installing n8n {VERSION} into {INSTALL_DIR} (npm ci, about 5 minutes) ...", flush=True)
    subprocess.run(
        ["npm", "ci", "--omit=dev", "--no-audit", "--no-fund"],
        cwd=INSTALL_DIR,
        env=env,
        check=True,
    )
    binary = INSTALL_DIR / "node_modules" / ".bin" / "n8n"
    if not binary.exists():
        raise N8nUnavailable(f"npm ci finished but {binary} is missing")
    return binary


@dataclass
class N8n:
    """One n8n home (sqlite) and the `n8n` commands run against it."""

    binary: Path
    home: Path
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{PORT}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(BASE_ENV)
        env["N8N_USER_FOLDER"] = str(self.home)
        env.update(self.extra_env)
        return env

    def cli(self, *args: str) -> str:
        """Run one `n8n` command (import, publish) to completion; its output on failure."""
        with (self.log_dir / "n8n-cli.log").open("ab") as log:
            log.write(f"\n$ n8n {' '.join(args)}\n".encode())
            log.flush()
            done = subprocess.run(
                [str(self.binary), *args],
                env=self.env(),
                cwd=self.home,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=300,
                check=False,
            )
            log.write(done.stdout)
        text = done.stdout.decode(errors="replace")
        if done.returncode != 0:
            command = " ".join(args)
            raise N8nUnavailable(f"n8n {command} failed ({done.returncode}):\n{text[-3000:]}")
        return text

    def import_credentials(self, credentials: list[dict[str, Any]]) -> None:
        """Credentials with plain `data`: n8n encrypts an object on import."""
        path = self.home / "credentials.json"
        path.write_text(json.dumps(credentials), encoding="utf-8")
        self.cli("import:credentials", f"--input={path}")
        path.unlink()

    def import_workflows(self, workflows: list[dict[str, Any]]) -> None:
        folder = self.home / "workflows"
        folder.mkdir(exist_ok=True)
        for workflow in workflows:
            (folder / f"{workflow['id']}.json").write_text(json.dumps(workflow), encoding="utf-8")
        self.cli("import:workflow", "--separate", f"--input={folder}")
        for workflow in workflows:
            # Publishing takes effect when n8n starts.
            self.cli("publish:workflow", f"--id={workflow['id']}")

    def start(self) -> None:
        for port in (PORT, BROKER_PORT):
            if not port_free(port):
                raise N8nUnavailable(f"port {port} is taken: is another n8n running?")
        path = self.log_dir / "n8n.log"
        # A restart appends to the log: only this start's lines say it is ready.
        started_at = path.stat().st_size if path.exists() else 0
        with path.open("ab") as log:
            self.process = subprocess.Popen(
                [str(self.binary), "start"],
                env=self.env(),
                cwd=self.home,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise N8nUnavailable(f"n8n exited with {self.process.returncode}:\n{self.log()}")
            try:
                ready = httpx.get(f"{self.url}/healthz/readiness", timeout=2).status_code == 200
                # Published workflows' webhooks are registered after the server is ready; this
                # line comes once they all are.
                if ready and ACTIVATED in self.log(since=started_at):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise N8nUnavailable(f"n8n not ready after {START_TIMEOUT_SECONDS} s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is not None:
            # n8n finishes running executions on SIGTERM; 30 s is plenty for this check's.
            terminate([self.process], grace=30)

    def rest(self) -> httpx.Client:
        """A signed-in client of n8n's own REST API (the editor's), the owner set up on first use:
        what a user does in the editor (unpublish, publish) done while n8n runs."""
        client = httpx.Client(
            base_url=f"{self.url}/rest", timeout=60, headers={"browser-id": "e2e"}
        )
        owner = {"email": "owner@example.com", "password": "E2e-owner-password-1"}
        setup = client.post("/owner/setup", json={**owner, "firstName": "E", "lastName": "Two"})
        if setup.status_code != 200:
            login = client.post(
                "/login",
                json={"emailOrLdapLoginId": owner["email"], "password": owner["password"]},
            )
            if login.status_code != 200:
                client.close()
                raise N8nUnavailable(f"n8n sign-in failed: {login.status_code} {login.text[:300]}")
        return client

    def unpublish_live(self, workflow_id: str) -> None:
        """Unpublish a workflow in the running n8n (its webhooks go at once)."""
        client = self.rest()
        with contextlib.closing(client):
            done = client.post(f"/workflows/{workflow_id}/deactivate", json={})
            if done.status_code != 200:
                raise N8nUnavailable(f"unpublish: {done.status_code} {done.text[:300]}")

    def publish_live(self, workflow_id: str) -> None:
        """Publish a workflow's current version in the running n8n."""
        client = self.rest()
        with contextlib.closing(client):
            found = client.get(f"/workflows/{workflow_id}")
            if found.status_code != 200:
                raise N8nUnavailable(f"workflow: {found.status_code} {found.text[:300]}")
            version_id = found.json()["data"]["versionId"]
            done = client.post(f"/workflows/{workflow_id}/activate", json={"versionId": version_id})
            if done.status_code != 200:
                raise N8nUnavailable(f"publish: {done.status_code} {done.text[:300]}")

    def log(self, tail: int = 4000, since: int | None = None) -> str:
        """The log's last `tail` characters, or everything after byte `since`."""
        path = self.log_dir / "n8n.log"
        if not path.exists():
            return ""
        if since is not None:
            with path.open("rb") as log:
                log.seek(since)
                return log.read().decode(errors="replace")
        return path.read_text(errors="replace")[-tail:]


def version(binary: Path) -> str:
    """`n8n --version` of the binary in use."""
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    return done.stdout.strip() or "unknown"


def execution_errors(home: Path) -> list[str]:
    """`workflow / last node: message` of every execution n8n recorded as failed (its sqlite)."""
    database = home / ".n8n" / "database.sqlite"
    if not database.exists():
        return []
    found = []
    with contextlib.closing(sqlite3.connect(database)) as conn:
        rows = conn.execute(
            "SELECT e.workflowId, d.data FROM execution_entity e"
            " JOIN execution_data d ON d.executionId = e.id"
            " WHERE e.status NOT IN ('success', 'running', 'waiting') ORDER BY e.id"
        ).fetchall()
    for workflow_id, data in rows:
        # n8n stores run data "flatted": objects refer to each other by index as strings.
        table = json.loads(data)
        result = table[int(table[0]["resultData"])]
        last = table[int(result["lastNodeExecuted"])] if "lastNodeExecuted" in result else "?"
        message = "?"
        if "error" in result:
            error = table[int(result["error"])]
            message = table[int(error["message"])] if "message" in error else "?"
        found.append(f"{workflow_id} / {last}: {message}")
    return found


def executions(home: Path, workflow_id: str) -> int:
    """How many executions n8n recorded for one workflow (its sqlite), finished or running."""
    database = home / ".n8n" / "database.sqlite"
    if not database.exists():
        return 0
    with contextlib.closing(sqlite3.connect(database)) as conn:
        (count,) = conn.execute(
            "SELECT count(*) FROM execution_entity WHERE workflowId = ?", (workflow_id,)
        ).fetchone()
    return int(count)


def _unflatten(table: list[Any]) -> Any:
    """n8n's stored run data ("flatted"): every object, array and string is an entry of one
    list, referred to by its index as a string; the root is entry 0."""
    done: dict[int, Any] = {}

    def revive(index: int) -> Any:
        if index in done:
            return done[index]
        entry = table[index]
        if isinstance(entry, dict):
            found: dict[str, Any] = {}
            done[index] = found
            found.update({k: revive(int(v)) if isinstance(v, str) else v for k, v in entry.items()})
            return found
        if isinstance(entry, list):
            items: list[Any] = []
            done[index] = items
            items.extend(revive(int(v)) if isinstance(v, str) else v for v in entry)
            return items
        return entry

    return revive(0)


@dataclass(frozen=True)
class WebhookRun:
    """One execution of a workflow started by its Webhook node, as n8n recorded it."""

    id: int
    status: str
    started_at: str | None
    stopped_at: str | None
    body: Any


def webhook_runs(home: Path, workflow_id: str, node: str = "Webhook") -> list[WebhookRun]:
    """Every execution of one workflow in the order n8n started them, with the request body its
    Webhook node received (its sqlite)."""
    database = home / ".n8n" / "database.sqlite"
    if not database.exists():
        return []
    with contextlib.closing(sqlite3.connect(database)) as conn:
        rows = conn.execute(
            "SELECT e.id, e.status, e.startedAt, e.stoppedAt, d.data FROM execution_entity e"
            " JOIN execution_data d ON d.executionId = e.id"
            " WHERE e.workflowId = ? ORDER BY e.id",
            (workflow_id,),
        ).fetchall()
    runs = []
    for execution_id, status, started_at, stopped_at, data in rows:
        run_data = _unflatten(json.loads(data))["resultData"]["runData"]
        body = None
        if node in run_data:
            body = run_data[node][0]["data"]["main"][0][0]["json"].get("body")
        runs.append(WebhookRun(int(execution_id), str(status), started_at, stopped_at, body))
    return runs
