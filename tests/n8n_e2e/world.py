"""Everything the workflows talk to, started for one run and torn down after it.

A database and a Redis of the run's own, the gateway's receiver, relay, worker and sweeper (as
tests/support.py `Stack` starts them), a second receiver whose signing secret was rotated, a
TCP proxy in front of the receivers (cut it and the gateway is down for n8n), the fake CRM
(tests/support.py `Downstream`, which also plays 10's CRM, ledger and chat notifier, a path
each), the scripted chat model, the lane route and the CRM source of examples/routes.toml
(09's), its fan-out route with its destinations and the Stripe source (10's), and n8n with the
n8n-nodes-idem package installed (tests/n8n_e2e/idem_node.py) and every workflow of
examples/n8n imported, its Config pointed here, its credentials created and published.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import tempfile
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

from outbox.store import embedded
from outbox.store.migrate import upgrade
from tests.n8n_e2e import idem_node
from tests.n8n_e2e.model import ScriptedModel
from tests.n8n_e2e.n8n import N8n
from tests.n8n_e2e.trigger_world import look_route, look_workflow
from tests.support import (
    CLAIMS_TOKEN,
    PROVIDER_SECRETS,
    ROOT,
    Downstream,
    Stack,
    TcpProxy,
    libpq,
    write_routes,
)

EXAMPLES = ROOT / "examples" / "n8n"
ARTIFACTS = ROOT / "test-artifacts" / "n8n-e2e"
SOURCE = "webform"
SIGNING_SECRET = "whsec_n8n_e2e_0123456789abcdef-source"
ROTATED_SECRET = "whsec_n8n_e2e_rotated_fedcba9876"
# The `trigger` route's Standard Webhooks secret: the gateway signs what it sends to 07's Idem
# Trigger with it, and the trigger checks it (the Idem API credential's Delivery Signing Secret).
TRIGGER_SECRET = "whsec_" + base64.b64encode(b"n8n-e2e-trigger-delivery-secret!").decode()
# 07's Idem Trigger path, and the gateway route that sends to it (event types `trigger.*`).
TRIGGER_PATH = "idem-trigger-crm"
TRIGGER_READ_TIMEOUT_SECONDS = 3
# Credential ids the example workflows name; a user picks their own after importing.
CLAIMS_CREDENTIAL = "idemClaimsToken1"
SIGNING_CREDENTIAL = "idemWebhookSign1"
MODEL_CREDENTIAL = "idemOpenAiModel1"
IDEM_NODE_CREDENTIAL = "idemApiCredent01"
# 09: the CRM's contact updates through the lane route `crm-contacts` of examples/routes.toml,
# signed as its source `crm` (Standard Webhooks) with this secret.
CONTACTS_ROUTE = "crm-contacts"
CONTACTS_SOURCE = "crm"
CONTACTS_SECRET = "whsec_" + base64.b64encode(b"n8n-e2e-crm-contact-updates-key!").decode()
# 10: the fan-out route of examples/routes.toml, its destinations (the CRM, 10's workflow, the
# chat notifier) and the Stripe source, signed with this secret.
INVOICE_ROUTE = "stripe-invoice-paid"
STRIPE_SOURCE = "stripe"
STRIPE_SECRET = PROVIDER_SECRETS[STRIPE_SOURCE][1]
EXAMPLE_ROUTES = ROOT / "examples" / "routes.toml"


@dataclass
class World:
    stack: Stack
    rotated: Stack
    proxy: TcpProxy
    crm: Downstream
    model: ScriptedModel
    n8n: N8n
    workflows: dict[str, dict[str, Any]]

    @property
    def gateway_url(self) -> str:
        """The gateway as n8n reaches it: through the proxy."""
        return f"http://127.0.0.1:{self.proxy.port}"

    def gateway_down(self) -> None:
        self.proxy.cut()

    def gateway_up(self, rotated: bool = False) -> None:
        """Serve n8n again, from the receiver with the rotated secret when asked."""
        self.proxy.cut()
        self.proxy.target = ("127.0.0.1", (self.rotated if rotated else self.stack).port)
        self.proxy.start()

    def webhook(self, path: str) -> str:
        return f"{self.n8n.url}/webhook/{path}"

    def key_status(self, key: str) -> str | None:
        with psycopg.connect(libpq(self.stack.database_url), autocommit=True) as conn:
            row = conn.execute(
                "SELECT status FROM idempotency_keys WHERE idempotency_key = %s", (key,)
            ).fetchone()
        return None if row is None else str(row[0])


def _admin_url() -> str:
    return os.environ.get(
        "TEST_DATABASE_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )


def _database(admin_url: str, name: str) -> str:
    base, _, query = admin_url.partition("?")
    return base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")


@contextlib.contextmanager
def own_database() -> Iterator[str]:
    """A database of this run's own, migrated to head, dropped at the end."""
    admin = _admin_url()
    name = f"idem_n8n_e2e_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(libpq(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = _database(admin, name)
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(libpq(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def configured(workflow: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
    """The workflow with its Config nodes' values set, as a user does after importing."""
    copy = json.loads(json.dumps(workflow))
    for node in copy["nodes"]:
        if not node["name"].startswith("Config"):
            continue
        for assignment in node["parameters"]["assignments"]["assignments"]:
            if assignment["name"] in values:
                assignment["value"] = values[assignment["name"]]
    return copy


def _toml_table(kind: str, table: dict[str, Any]) -> str:
    """One `[[kind]]` table of scalars and lists (JSON's string syntax is TOML's)."""
    assert not any(isinstance(value, dict) for value in table.values()), table
    lines = "".join(f"{name} = {json.dumps(value)}\n" for name, value in table.items())
    return f"[[{kind}]]\n{lines}\n"


def _example() -> dict[str, Any]:
    return tomllib.loads(EXAMPLE_ROUTES.read_text(encoding="utf-8"))


def _within_the_run(table: dict[str, Any]) -> dict[str, Any]:
    """A route's or destination's timeouts within the stack's LEASE_SECONDS (5 s) and its backoff
    shortened, so a retry comes within the run."""
    return {
        **table,
        "connect_timeout_seconds": 1,
        "read_timeout_seconds": 3,
        "backoff_base_seconds": 0.5,
        "backoff_cap_seconds": 2,
    }


def _rebased(url: str, base: str) -> str:
    """`url`'s path (and query) under `base` instead of its own scheme, host and port."""
    parts = urlsplit(url)
    return base.rstrip("/") + parts.path + (f"?{parts.query}" if parts.query else "")


def example_contacts_route(n8n_url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The lane route and its provider source as examples/routes.toml declares them, the route's
    URL pointed at this n8n's webhook of examples/n8n/09 and the source's secret at this run's."""
    example = _example()
    route = next(r for r in example["routes"] if r.get("name") == CONTACTS_ROUTE)
    source = next(s for s in example["sources"] if s["name"] == CONTACTS_SOURCE)
    route = _within_the_run({**route, "url": _rebased(route["url"], n8n_url)})
    return route, {**source, "secret": CONTACTS_SECRET}


def example_invoice_fan_out(
    n8n_url: str, downstream_url: str
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The fan-out route, its destinations and the Stripe source as examples/routes.toml declares
    them: the n8n destination pointed at this n8n (10's webhook), every other one at the fake
    downstream under a path of its own (`/crm/tasks`, `/slack/notify`), the source's secret at
    this run's."""
    example = _example()
    route = next(r for r in example["routes"] if r.get("name") == INVOICE_ROUTE)
    destinations = []
    for table in example["destinations"]:
        if table["name"] not in route["fan_out"]:
            continue
        base = n8n_url if table.get("kind") == "n8n" else f"{downstream_url}/{table['name']}"
        moved = {
            name: _rebased(table[name], base) for name in ("url", "reconcile_url") if name in table
        }
        destinations.append(_within_the_run({**table, **moved}))
    source = next(s for s in example["sources"] if s["name"] == STRIPE_SOURCE)
    return route, destinations, {**source, "secrets": [STRIPE_SECRET]}


def run_routes(path: Path, downstream_url: str, n8n_url: str) -> Path:
    """The run's routes file: tests/support.py's routes (the CRM's `crm.*`, the catch-all ...),
    with 09's lane route, 07's trigger routes (tests/n8n_e2e/trigger_world.py's beside the
    `trigger` route) and 10's fan-out route before the catch-all (the
    first match wins), 10's destinations, and 09's and 10's sources in place of tests/support.py's
    Stripe source. tests/support.py's own fan-out routes and destinations belong to the
    integration tests, and its route `crm` would share its name with 10's destination: the
    former are left out, the latter is renamed `crm-tasks`."""
    base = tomllib.loads(write_routes(path, downstream_url).read_text(encoding="utf-8"))
    contacts_route, contacts_source = example_contacts_route(n8n_url)
    invoice_route, destinations, stripe = example_invoice_fan_out(n8n_url, downstream_url)
    trigger_route = {
        "match": "trigger.*",
        "name": "trigger",
        "kind": "n8n",
        "action": "http",
        "url": f"{n8n_url}/webhook/{TRIGGER_PATH}",
        "signing_secret": TRIGGER_SECRET,
        "read_timeout_seconds": TRIGGER_READ_TIMEOUT_SECONDS,
        "connect_timeout_seconds": 1,
        "backoff_base_seconds": 0.5,
        "backoff_cap_seconds": 2,
        "max_attempts": 4,
    }
    taken = {d["name"] for d in destinations}
    routes = [
        {**r, "name": f"{r['name']}-tasks"} if r.get("name") in taken else r
        for r in base["routes"]
        if "fan_out" not in r
    ]
    catch_all = [r for r in routes if r["match"] == "*"]
    routes = [r for r in routes if r["match"] != "*"]
    look = look_route(n8n_url, TRIGGER_SECRET)
    routes += [contacts_route, trigger_route, look, invoice_route, *catch_all]
    sources = [s for s in base["sources"] if s["name"] != STRIPE_SOURCE]
    sources += [contacts_source, stripe]
    path.write_text(
        "".join(_toml_table("routes", r) for r in routes)
        + "".join(_toml_table("destinations", d) for d in destinations)
        + "".join(_toml_table("sources", s) for s in sources),
        encoding="utf-8",
    )
    return path


def example_workflows() -> dict[str, dict[str, Any]]:
    """Every workflow file of examples/n8n by file name."""
    return {
        path.name: json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(EXAMPLES.glob("*.json"))
    }


@contextlib.contextmanager
def world(binary: Path, keep: bool = False) -> Iterator[World]:
    work = Path(tempfile.mkdtemp(prefix="idem-n8n-e2e-"))
    logs = work / "logs"
    logs.mkdir()
    crm = Downstream()
    crm_server = crm.start()
    model = ScriptedModel().start()
    redis_process, redis_url = embedded.start_redis(work / "redis", appendonly=False)
    n8n = N8n(binary=binary, home=work / "n8n-home", log_dir=logs)
    routes = run_routes(work / "routes.toml", crm.url, n8n.url)
    n8n.home.mkdir()
    stack = rotated = None
    proxy = TcpProxy()
    try:
        idem_node.install(n8n.home, logs)
        with own_database() as database_url:
            env = {"WEBHOOK_SECRETS": f"{SOURCE}={SIGNING_SECRET}"}
            stack = Stack(database_url, redis_url, routes, logs, extra_env=dict(env))
            stack.start_all()
            stack.start_sweeper()
            rotated = Stack(
                database_url,
                redis_url,
                routes,
                logs,
                extra_env={**env, "WEBHOOK_SECRETS": f"{SOURCE}={ROTATED_SECRET}"},
            )
            rotated.start_receiver()
            proxy.target = ("127.0.0.1", stack.port)
            proxy.start()
            values = {
                "IDEM_URL": f"http://127.0.0.1:{proxy.port}",
                "CRM_URL": crm.url,
                # 10's ledger: the fake downstream under a path of its own.
                "FINANCE_URL": f"{crm.url}/finance",
            }
            workflows = {
                name: configured(workflow, values) for name, workflow in example_workflows().items()
            }
            n8n.import_credentials(
                [
                    {
                        "id": CLAIMS_CREDENTIAL,
                        "name": "idem claims token",
                        "type": "httpBearerAuth",
                        "data": {"token": CLAIMS_TOKEN},
                    },
                    {
                        "id": SIGNING_CREDENTIAL,
                        "name": "idem webhook signing secret",
                        "type": "crypto",
                        "data": {"hmacSecret": SIGNING_SECRET},
                    },
                    {
                        "id": IDEM_NODE_CREDENTIAL,
                        "name": "Idem API",
                        "type": "idemApi",
                        "data": {
                            "baseUrl": values["IDEM_URL"],
                            "claimsToken": CLAIMS_TOKEN,
                            # 06 sends events as the source `webform`, which is signed.
                            "signingSecret": SIGNING_SECRET,
                            # 07's Idem Trigger checks the `trigger` route's signature.
                            "deliverySigningSecret": TRIGGER_SECRET,
                        },
                    },
                    {
                        "id": MODEL_CREDENTIAL,
                        "name": "OpenAI account",
                        "type": "openAiApi",
                        "data": {"apiKey": "sk-scripted-no-key", "url": model.url},
                    },
                ]
            )
            imported = [*workflows.values(), look_workflow(workflows["07-idem-trigger.json"])]
            n8n.import_workflows(imported)
            n8n.start()
            yield World(stack, rotated, proxy, crm, model, n8n, workflows)
    finally:
        n8n.stop()
        proxy.stop()
        for one in (rotated, stack):
            if one is not None:
                one.stop_all()
        redis_process.terminate()
        redis_process.wait(timeout=10)
        model.stop()
        crm_server.shutdown()
        crm_server.server_close()
        # The processes' logs outlive the run (test-artifacts/ is git-ignored).
        shutil.rmtree(ARTIFACTS, ignore_errors=True)
        shutil.copytree(logs, ARTIFACTS)
        if keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
