"""Proxies are trusted exactly: a receiver behind a proxy on 127.0.0.2 (a second loopback
address, the only one FORWARDED_ALLOW_IPS names) resolves each client through it, a spoofed
chain does not make a client local, wrong tokens lock out their own client and never the right
token, and trusting every address stops the start."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, Stack, refused_start

PROXY = "127.0.0.2"


def _through_proxy(stack: Stack) -> httpx.Client:
    """A client whose connections come from the proxy's address."""
    return httpx.Client(
        base_url=stack.url, timeout=15, transport=httpx.HTTPTransport(local_address=PROXY)
    )


def _for(client: str, token: str | None = None) -> dict[str, str]:
    """The headers the proxy forwards for `client`, with its bearer token if any."""
    headers = {"X-Forwarded-For": client}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


@pytest.mark.parametrize("trusted", ["*", PROXY])
def test_a_spoofed_chain_never_reaches_what_is_for_local_clients(
    trusted: str, database_url: str, redis_url: str, routes_file: Path, tmp_path: Path
) -> None:
    """`X-Forwarded-For: 127.0.0.1, 203.0.113.5` sent through the proxy never makes a local
    client (no claims or metrics token set: loopback only). Trusting `*`, the receiver does
    not start; trusting the proxy, the client is 203.0.113.5: /metrics answers 403 and a claim
    without a token is refused, while the proxy naming 127.0.0.1 alone is a local client."""
    stack = Stack(
        database_url,
        redis_url,
        routes_file,
        tmp_path,
        extra_env={"FORWARDED_ALLOW_IPS": trusted, "CLAIMS_TOKEN": "", "METRICS_TOKEN": ""},
    )
    try:
        stack.start_receiver()
    except RuntimeError:
        assert trusted == "*", stack.logs("receiver")
        assert "FORWARDED_ALLOW_IPS" in stack.logs("receiver")
        return
    try:
        spoofed = _for("127.0.0.1, 203.0.113.5")
        with _through_proxy(stack) as client:
            metrics = client.get("/metrics", headers=spoofed)
            claim = client.post("/v1/claims", json={"key": "spoofed-1"}, headers=spoofed)
            local = client.get("/metrics", headers=_for("127.0.0.1"))
    finally:
        stack.stop_all()
    assert metrics.status_code == 403, metrics.text[:300]
    assert metrics.json()["error"] == "metrics_forbidden"
    assert claim.status_code == 403, claim.text[:300]
    assert claim.json()["error"] == "claims_forbidden"
    assert local.status_code == 200


@pytest.fixture
def tokens() -> dict[str, str]:
    """Strong tokens of 40 characters for the three realms."""
    return {name: secrets.token_urlsafe(30) for name in ("operator", "claims", "metrics")}


@pytest.fixture
def guarded_behind_proxy(
    database_url: str,
    redis_url: str,
    routes_file: Path,
    tmp_path: Path,
    tokens: dict[str, str],
) -> Iterator[Stack]:
    """A receiver trusting only the proxy, with every token set and the default limit of ten
    wrong credentials per address."""
    stack = Stack(
        database_url,
        redis_url,
        routes_file,
        tmp_path,
        extra_env={
            "FORWARDED_ALLOW_IPS": PROXY,
            "AUTH_FAILURE_LIMIT": "10",
            "OPERATOR_TOKEN": tokens["operator"],
            "CLAIMS_TOKEN": tokens["claims"],
            "METRICS_TOKEN": tokens["metrics"],
        },
    )
    stack.start_receiver()
    yield stack
    stack.stop_all()


def test_wrong_tokens_lock_out_their_client_and_never_the_right_token(
    guarded_behind_proxy: Stack, tokens: dict[str, str]
) -> None:
    """Ten wrong tokens forwarded for 203.0.113.5 make its next wrong ones 429 with
    Retry-After (API and console sign-in); the right tokens from 203.0.113.5 and from
    203.0.113.6, behind the same proxy, are served on /v1/claims, /v1/stats, /metrics and the
    console sign-in."""
    attacker, neighbour = "203.0.113.5", "203.0.113.6"
    with _through_proxy(guarded_behind_proxy) as client:
        wrong = [
            client.get("/v1/stats", headers=_for(attacker, f"guess-{n}")) for n in range(4)
        ] + [client.get("/metrics", headers=_for(attacker, f"guess-{n}")) for n in range(3)]
        wrong += [
            client.post("/v1/claims", json={"key": "k"}, headers=_for(attacker, f"guess-{n}"))
            for n in range(2)
        ]
        wrong.append(
            client.post("/console/sign-in", data={"token": "guess-9"}, headers=_for(attacker))
        )
        assert [answer.status_code for answer in wrong] == [401] * 10
        held = [
            client.get("/v1/stats", headers=_for(attacker, "guess-10")),
            client.post("/console/sign-in", data={"token": "guess-11"}, headers=_for(attacker)),
        ]
        for answer in held:
            assert answer.status_code == 429, answer.text[:300]
            assert 1 <= int(answer.headers["retry-after"]) <= 300
        assert held[0].json()["error"] == "too_many_failures"

        for address in (attacker, neighbour):
            stats = client.get("/v1/stats", headers=_for(address, tokens["operator"]))
            metrics = client.get("/metrics", headers=_for(address, tokens["metrics"]))
            claim = client.post(
                "/v1/claims",
                json={"key": f"proxied-{address}"},
                headers=_for(address, tokens["claims"]),
            )
            sign_in = client.post(
                "/console/sign-in", data={"token": tokens["operator"]}, headers=_for(address)
            )
            assert stats.status_code == 200, (address, stats.text[:300])
            assert metrics.status_code == 200, (address, metrics.text[:300])
            assert claim.status_code == 201, (address, claim.text[:300])
            assert sign_in.status_code == 303, (address, sign_in.text[:300])
            client.cookies.clear()


def test_tokenless_requests_are_throttled_per_address_and_logged_sampled(
    guarded_behind_proxy: Stack, tokens: dict[str, str]
) -> None:
    """Forty requests without a token forwarded for one address: the first ten are 401, the
    rest 429 with Retry-After; the log says so in one `auth.refused` and one `auth.throttled`
    line for that address (each with how many refusals it stands for), and the right token
    from that address and a neighbour's tokenless request are still answered as before."""
    knocker, neighbour = "203.0.113.7", "203.0.113.8"
    with _through_proxy(guarded_behind_proxy) as client:
        answers = [client.get("/v1/stats", headers=_for(knocker)) for _ in range(40)]
        assert [a.status_code for a in answers] == [401] * 10 + [429] * 30
        assert answers[-1].json()["error"] == "too_many_failures"
        assert client.get("/v1/stats", headers=_for(neighbour)).status_code == 401
        right = client.get("/v1/stats", headers=_for(knocker, tokens["operator"]))
        assert right.status_code == 200, right.text[:300]
    lines = [
        json.loads(line)
        for line in guarded_behind_proxy.logs("receiver").splitlines()
        if knocker in line and '"auth.' in line
    ]
    assert [(e["event"], e["refusals"]) for e in lines] == [
        ("auth.refused", 1),
        ("auth.throttled", 1),
    ], lines


@pytest.mark.parametrize(
    "everyone", ["*", "0.0.0.0/0", "::/0", "10.0.0.5, 0/0", "0.0.0.0/1,128.0.0.0/1"]
)
def test_trusting_every_proxy_address_stops_the_start(tmp_path: Path, everyone: str) -> None:
    """`idem serve` with FORWARDED_ALLOW_IPS trusting every address (`*`, or networks that
    hold every IPv4 or IPv6 address) exits 2 with one line naming the setting, before it binds
    its port."""
    env = dict(
        os.environ,
        DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        REDIS_URL="redis://127.0.0.1:1/0",
        FORWARDED_ALLOW_IPS=everyone,
        PYTHONPATH=str(ROOT),
    )
    env.pop("ROUTES_FILE", None)
    run = refused_start(tmp_path, env)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "FORWARDED_ALLOW_IPS" in lines[0], run.stderr
