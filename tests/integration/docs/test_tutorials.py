"""The n8n and Stripe tutorials' gateway side, as written: their routes files load, and the
Stripe tutorial's signed delivery, sent twice to a receiver with its routes file, is stored
once and answered as a duplicate the second time. (The n8n side, the Idem Trigger starting
one execution per key, is `make n8n-e2e`'s `07-idem-trigger.json`.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from outbox.core.routes import load_routes
from tests.support import ROOT, Stack

TUTORIALS = ROOT / "docs" / "tutorials"
SECRETS = {
    "N8N_SIGNING_SECRET": "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk=",
    "STRIPE_WEBHOOK_SECRET": "whsec_9f1c0a7be35d42c68e0b1f7d2a4c6e8b0d2f4a6c8e0b1d3f",
}


def _blocks(page: str, language: str) -> list[str]:
    text = (TUTORIALS / page).read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def _routes_file(tmp_path: Path, page: str) -> Path:
    path = tmp_path / f"{page}.toml"
    path.write_text("\n".join(_blocks(page, "toml")), encoding="utf-8")
    return path


@pytest.mark.parametrize("page", ["n8n-exactly-once.md", "stripe-to-n8n.md"])
def test_the_tutorials_routes_file_loads(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's TOML is a valid routes file: its route calls the 07 workflow's trigger path,
    signed, and names n8n as the downstream."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    table = load_routes(_routes_file(tmp_path, page))
    route = table.resolve("trigger.lead" if page.startswith("n8n") else "invoice.paid")
    assert route is not None
    assert route.kind == "n8n" and route.all_signing_secrets == (SECRETS["N8N_SIGNING_SECRET"],)
    workflow = json.loads((ROOT / "examples/n8n/07-idem-trigger.json").read_text())
    trigger = next(n for n in workflow["nodes"] if n["type"].endswith("idemTrigger"))
    assert route.url is not None and route.url.endswith("/webhook/" + trigger["parameters"]["path"])


@pytest.mark.parametrize(
    ("page", "key_prefix"),
    [("n8n-exactly-once.md", "webform:trigger.lead:"), ("stripe-to-n8n.md", "stripe:webhook:")],
)
def test_the_tutorials_event_sent_twice_is_stored_once(
    page: str, key_prefix: str, own_database: str, redis_url: str, tmp_path: Path
) -> None:
    """The page's curl loop (an event, or the Stripe tutorial's signed delivery, sent twice),
    run as written against a receiver with the page's routes file: the first answer a new
    event, the second a duplicate of the same key."""
    receiver = Stack(
        own_database,
        redis_url,
        _routes_file(tmp_path, page),
        tmp_path,
        # The tutorial runs on the defaults (the stack's 5 s lease is for the tests' pace).
        extra_env={
            **SECRETS,
            "LEASE_SECONDS": "30",
            # The Stripe tutorial refuses unsigned sources; the n8n one sends from a web form.
            "REQUIRE_SIGNED_WEBHOOKS": str(page.startswith("stripe")).lower(),
        },
    )
    receiver.start_receiver()
    try:
        script = next(b for b in _blocks(page, "sh") if "for i in 1 2" in b)
        script = script.replace("localhost:8000", receiver.url.removeprefix("http://"))
        run = subprocess.run(
            ["bash", "-c", script],
            capture_output=True,
            text=True,
            timeout=30,
            env={**receiver.env(), **SECRETS},
        )
        assert run.returncode == 0, run.stderr
        first, again = (json.loads(line) for line in run.stdout.splitlines() if line.strip())
        assert (first.get("duplicate"), again.get("duplicate")) == (False, True), run.stdout
        assert first["key"] == again["key"] and first["key"].startswith(key_prefix)
    finally:
        receiver.stop_all()
