"""Console sessions and CSRF tokens: signed with a key derived from the operator token."""

from __future__ import annotations

from outbox.operate.console import session


def test_a_session_verifies_until_it_expires() -> None:
    """An issued session verifies with the same token and stops verifying after 8 hours."""
    issued = session.issue("token-a", now=1_000)
    assert issued.expires_at == 1_000 + 8 * 3600
    found = session.verify("token-a", issued.value, now=1_001)
    assert found is not None and found.csrf == issued.csrf
    assert session.verify("token-a", issued.value, now=issued.expires_at) is None


def test_rotating_the_token_signs_everyone_out() -> None:
    """A session signed under one operator token is refused under another (and with none)."""
    issued = session.issue("token-a", now=1_000)
    assert session.verify("token-b", issued.value, now=1_001) is None
    assert session.verify("", issued.value, now=1_001) is None


def test_a_tampered_session_is_refused() -> None:
    """Changing the expiry, the nonce or the signature, or sending garbage, yields no session."""
    issued = session.issue("token-a", now=1_000)
    version, expires, nonce, signature = issued.value.split(".")
    for forged in (
        f"{version}.{int(expires) + 3600}.{nonce}.{signature}",
        f"{version}.{expires}.{nonce}x.{signature}",
        f"{version}.{expires}.{nonce}.{'0' * 64}",
        f"v2.{expires}.{nonce}.{signature}",
        "garbage",
        "",
        None,
        "v1." + "9" * 300,
    ):
        assert session.verify("token-a", forged, now=1_001) is None, forged


def test_the_csrf_token_belongs_to_its_session() -> None:
    """A form's CSRF token matches its own session only, and never when absent."""
    first = session.issue("token-a", now=1_000)
    second = session.issue("token-a", now=1_000)
    assert session.csrf_matches(first, first.csrf)
    assert not session.csrf_matches(first, second.csrf)
    assert not session.csrf_matches(first, None)
    assert not session.csrf_matches(first, "")
    assert not session.csrf_matches(first, first.csrf[:-1])


def test_the_sign_in_check_needs_the_exact_token() -> None:
    """The operator token matches itself (surrounding blanks aside), nothing else, and an
    unset token matches nothing."""
    assert session.token_matches("token-a", "token-a")
    assert session.token_matches("token-a", " token-a\n")
    assert not session.token_matches("token-a", "token-b")
    assert not session.token_matches("token-a", "")
    assert not session.token_matches("", "")
