"""The strength rule of tokens and secrets: what starts a process and what refuses it."""

from __future__ import annotations

import base64
import random
import secrets
import string

import pytest

from outbox.core import strength
from outbox.core.routes import Route, Source
from outbox.core.settings import Settings
from outbox.core.tokens import TokenError, check_settings, check_tokens

# Made once with `openssl rand -hex 16`, `-hex 32` and `-base64 32`.
OPENSSL_HEX_16 = "2483433c2ea714f3e48cf63e0fe5bce3"
OPENSSL_HEX_32 = "622f13c525dfb5b43068215e1504c5bf9106354df2856b8abbcb5acde425bfd6"
OPENSSL_BASE64_32 = "xEtyt2UcBU5GDoHVTTtUye9wI3/vE9DvFModMcHhp3M="

ACCEPTED = [
    OPENSSL_HEX_16,
    OPENSSL_HEX_32,
    OPENSSL_BASE64_32,
    "test-operator-token-0123456789abcdef",
    # Stripe's dashboard secret (whsec_ + 32 letters and digits) and its CLI's (64 hex digits).
    "whsec_Kw4gGS2yHrutHCWnDB4D4zMY2cF7AL2m",
    "whsec_" + OPENSSL_HEX_32,
    # Shopify: an app's client secret (32 hex digits, newer ones after shpss_) and the key the
    # admin's notifications page shows (64 hex digits).
    "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",
    OPENSSL_HEX_32,
]

REFUSED = [
    ("a", "shorter than 32 characters"),
    ("s3cret", "shorter than 32 characters"),
    ("x" * 31, "shorter than 32 characters"),
    # The token: 31 spaces and one letter.
    (" " * 31 + "a", "a space"),
    ("a" * 31 + "b", "easy to guess"),
    ("changeme" * 4, "easy to guess"),
    ("abcdefgh" * 4, "easy to guess"),
    ("password1" * 3 + "passw", "easy to guess"),
    (OPENSSL_HEX_16[:16] + " " + OPENSSL_HEX_16[16:], "a space"),
    (OPENSSL_HEX_32 + "\n", "a control character"),
    (OPENSSL_HEX_16 + "\t", "a control character"),
    (OPENSSL_HEX_16 + "é", "outside ASCII"),
]


@pytest.mark.parametrize("value", ACCEPTED)
def test_generated_and_provider_secrets_are_accepted(value: str) -> None:
    """Random values of 32 characters or more, and the providers' real formats, pass."""
    assert strength.weakness(value) is None


@pytest.mark.parametrize(("value", "reason"), REFUSED)
def test_weak_shapes_are_refused_with_their_reason(value: str, reason: str) -> None:
    """Short values, whitespace and control characters, few distinct characters and a
    repeated pattern are refused; the reason never quotes the value."""
    found = strength.weakness(value)
    assert found is not None
    assert reason in found
    if len(value.strip()) > 3:
        assert value.strip() not in found


# The weak tokens: shapes the former hand-written rules let through.
GUESSABLE = [
    "aaaaaaaaaaaaaaaaaaaaaaaaabcdefgh",
    "Password1Password2Password3Pass!",
    "0123456789abcdef0123456789abcdeg",
]


@pytest.mark.parametrize("value", GUESSABLE)
def test_tokens_of_words_runs_and_sequences_are_refused(value: str) -> None:
    """A run with a sequence at its end, numbered dictionary words and a hex sequence with
    one digit changed are each refused by the estimator, as a token and as FLOWER_PASSWORD."""
    found = strength.weakness(value)
    assert found is not None and "easy to guess" in found and value not in found
    with pytest.raises(TokenError, match="FLOWER_PASSWORD is easy to guess"):
        check_settings(Settings(flower_password=value))


def test_openssl_hex_16_passes_over_many_draws() -> None:
    """`openssl rand -hex 16` (what the docs' token minimum is measured against) passes in 300
    seeded draws and 60 fresh ones (never below 10^27 guesses in 3 000 draws measured). Each
    draw costs the estimator a few milliseconds, so more draws only lengthen the suite."""
    rng = random.Random(25)
    for _ in range(300):
        assert strength.weakness("".join(rng.choices("0123456789abcdef", k=32))) is None
    for _ in range(60):
        assert strength.weakness(secrets.token_hex(16)) is None
        assert strength.weakness(secrets.token_urlsafe(32)) is None


@pytest.mark.parametrize(
    ("secret", "reason"),
    [
        ("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", None),
        ("whsec_" + base64.b64encode(bytes(range(64))).decode(), None),
        ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", None),
        ("whsec_c2hvcnQ=", "shorter than 24 bytes"),
        ("whsec_" + base64.b64encode(bytes(32)).decode(), "easy to guess"),
        ("whsec_" + base64.b64encode(bytes(range(8)) * 4).decode(), "easy to guess"),
        ("whsec_not*base64", "not whsec_ followed by base64"),
    ],
)
def test_standard_webhooks_secrets_are_judged_on_their_key(secret: str, reason: str | None) -> None:
    """A Standard Webhooks secret decodes to 24 bytes at least, hard to guess as hex."""
    found = strength.standard_weakness(secret)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


def test_a_weak_token_or_webhook_secret_is_named_never_quoted() -> None:
    """check_tokens names each weak token and each source whose WEBHOOK_SECRETS entry is
    weak, says how to make one, and never prints a value."""
    weak_token = "a" * 31 + "b"
    with pytest.raises(TokenError) as refused:
        check_tokens(
            [
                ("OPERATOR_TOKEN", weak_token),
                ("CLAIMS_TOKEN", ""),
                ("METRICS_TOKEN", OPENSSL_HEX_16),
            ],
            f"weak=a,good={OPENSSL_HEX_32},Other=s3cret-s3cret",
        )
    message = str(refused.value)
    assert "OPERATOR_TOKEN is easy to guess" in message
    assert "WEBHOOK_SECRETS (source 'weak')" in message
    assert "WEBHOOK_SECRETS (source 'other')" in message
    assert "CLAIMS_TOKEN" not in message and "METRICS_TOKEN" not in message
    assert "'good'" not in message
    assert "openssl rand -hex 32" in message
    assert weak_token not in message and "s3cret" not in message
    check_tokens([("OPERATOR_TOKEN", OPENSSL_HEX_16)], f"good={OPENSSL_HEX_32}")


def test_a_malformed_webhook_secrets_is_a_token_error() -> None:
    """WEBHOOK_SECRETS that is not `source=secret` pairs is refused like a weak one."""
    with pytest.raises(TokenError, match="comma-separated list of source=secret"):
        check_tokens([], "just-a-secret-without-a-source-name")


@pytest.mark.parametrize("scheme", ["hmac", "stripe", "github", "shopify"])
def test_a_routes_file_source_with_a_weak_secret_is_refused(scheme: str) -> None:
    """A `[[sources]]` secret follows the rule: the error names the source, not the secret."""
    with pytest.raises(ValueError, match="source 'billing': a secret is shorter") as refused:
        Source(name="billing", scheme=scheme, secrets=[OPENSSL_HEX_32, "s3cret-s3cret-1234"])
    assert "s3cret" not in str(refused.value)
    assert Source(name="billing", scheme=scheme, secret=OPENSSL_HEX_32).all_secrets


def test_a_weak_route_signing_secret_is_refused() -> None:
    """A route's `signing_secret` is a Standard Webhooks key of 24 bytes hard to guess."""
    weak = "whsec_" + base64.b64encode(b"\x01" * 32).decode()
    with pytest.raises(ValueError, match="route 'crm': a `signing_secret` is easy to guess"):
        Route(match="crm.*", name="crm", action="http", url="http://crm", signing_secret=weak)


def test_a_random_printable_string_of_32_passes() -> None:
    """Any 32 characters drawn at random from the printable ASCII set pass."""
    alphabet = string.ascii_letters + string.digits + string.punctuation
    for _ in range(300):
        assert strength.weakness("".join(secrets.choice(alphabet) for _ in range(32))) is None
