"""Unit tests for outbox.core.standard_webhooks against the specification's published example,
and for the signing settings of a route."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

import pytest

from outbox.core import standard_webhooks
from outbox.core.routes import Route, RoutesError, load_routes

# The example in the Standard Webhooks specification (and its libraries' test suites).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_PAYLOAD = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
# A second 32-byte key, for rotations.
OTHER_SECRET = "whsec_" + base64.b64encode(bytes(range(32, 64))).decode()


def test_the_specifications_example_signs_to_its_published_signature() -> None:
    """The published secret, id, timestamp and payload give the published signature."""
    key = standard_webhooks.decode_secret(SPEC_SECRET)
    assert (
        standard_webhooks.signature_header([key], SPEC_ID, SPEC_TIMESTAMP, SPEC_PAYLOAD)
        == SPEC_SIGNATURE
    )


def test_the_prefix_is_optional_and_a_non_base64_secret_is_refused() -> None:
    """A secret decodes with or without `whsec_`; one that is not base64 is a ValueError that
    does not quote it."""
    bare = SPEC_SECRET.removeprefix("whsec_")
    assert standard_webhooks.decode_secret(bare) == standard_webhooks.decode_secret(SPEC_SECRET)
    with pytest.raises(ValueError) as raised:
        standard_webhooks.decode_secret("whsec_not*base64!")
    assert "not*base64" not in str(raised.value)


def test_several_keys_give_one_space_separated_entry_each() -> None:
    """During a rotation the header carries `v1,<mac>` per key, in order, each verifiable by
    an HMAC computed here independently."""
    keys = [standard_webhooks.decode_secret(s) for s in (SPEC_SECRET, OTHER_SECRET)]
    header = standard_webhooks.signature_header(keys, SPEC_ID, SPEC_TIMESTAMP, SPEC_PAYLOAD)
    entries = header.split(" ")
    assert len(entries) == 2
    for key, entry in zip(keys, entries, strict=True):
        signed = f"{SPEC_ID}.{SPEC_TIMESTAMP}.".encode() + SPEC_PAYLOAD
        expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        assert entry == f"v1,{expected}"


def test_a_route_takes_one_secret_or_several_and_hides_them() -> None:
    """`signing_secret` and `signing_secrets` combine, first once each; the route's repr and
    dump never show a secret."""
    route = Route(
        match="crm.*",
        action="http",
        url="https://crm.example/tasks",
        signing_secret=SPEC_SECRET,
        signing_secrets=[OTHER_SECRET, SPEC_SECRET],
    )
    assert route.all_signing_secrets == (SPEC_SECRET, OTHER_SECRET)
    assert len(route.signing_keys) == 2
    shown = repr(route) + str(route.model_dump())
    assert "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" not in shown


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ('signing_secret = "whsec_not*base64"', "whsec_ followed by base64"),
        ('signing_secrets = ["whsec_c2hvcnQ="]', "shorter than 24 bytes"),
        ('action = "noop"\nsigning_secret = "' + SPEC_SECRET + '"', "belongs to an http route"),
    ],
)
def test_a_bad_signing_setting_is_a_clear_routes_error(
    tmp_path: Path, settings: str, message: str
) -> None:
    """A secret that does not decode, a key too short, or a secret on a non-http route stops
    the routes file from loading with a message that names the problem, not the secret."""
    action = "" if "action" in settings else 'action = "http"\nurl = "https://crm.example/t"\n'
    path = tmp_path / "routes.toml"
    path.write_text(f'[[routes]]\nmatch = "crm.*"\n{action}{settings}\n', encoding="utf-8")
    with pytest.raises(RoutesError, match=message) as raised:
        load_routes(path)
    assert "not*base64" not in str(raised.value)
    assert "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" not in str(raised.value)


def test_a_signing_secret_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`signing_secret = "${NAME}"` takes the secret from the environment."""
    monkeypatch.setenv("IDEM_TEST_SIGNING_SECRET", SPEC_SECRET)
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes]]\nmatch = "crm.*"\naction = "http"\nurl = "https://crm.example/t"\n'
        'signing_secret = "${IDEM_TEST_SIGNING_SECRET}"\n',
        encoding="utf-8",
    )
    route = load_routes(path).resolve("crm.lead")
    assert route is not None
    assert route.signing_keys == (standard_webhooks.decode_secret(SPEC_SECRET),)
