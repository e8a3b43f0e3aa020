"""Unit tests for worker.store.redact: credentials quoted in an error detail are replaced by
[redacted] before the detail is stored; ordinary text is left alone."""

from __future__ import annotations

import pytest

from worker.store import redact


@pytest.mark.parametrize(
    ("detail", "expected"),
    [
        ("Authorization: Bearer eyJhbGciOi.payload.sig", "Authorization: [redacted]"),
        ("authorization: bearer abc123", "authorization: [redacted]"),
        ("Authorization: Basic dXNlcjpwYXNz", "Authorization: [redacted]"),
        ("AUTHORIZATION=BASIC dXNlcjpwYXNz", "AUTHORIZATION=[redacted]"),
        ("Proxy-Authorization: Basic Zm9vOmJhcg==", "Proxy-Authorization: [redacted]"),
        ("X-Api-Key: k-123", "X-Api-Key: [redacted]"),
        ("GET /leads?api_key=sk_live_123&page=2", "GET /leads?api_key=[redacted]&page=2"),
        ("api-key: abc, then more", "api-key: [redacted], then more"),
        ("POST /hook?token=abc123 failed", "POST /hook?token=[redacted] failed"),
        ("access_token=xyz;", "access_token=[redacted];"),
        ("password: hunter2", "password: [redacted]"),
        ("login failed, password:hunter2", "login failed, password:[redacted]"),
        ("client_secret = s3cr3t", "client_secret = [redacted]"),
        ("Cookie: session=abc", "Cookie: [redacted]"),
    ],
)
def test_credentials_are_redacted(detail: str, expected: str) -> None:
    """A credential after a header name or key (`:` or `=`) is replaced by [redacted]."""
    assert redact(detail) == expected


def test_every_credential_in_one_detail_is_redacted() -> None:
    """Several credentials in one detail are all replaced, and the text around them kept."""
    detail = (
        "request to https://crm.example/x?api_key=AAA&token=BBB with "
        "Authorization: Bearer CCC failed, password: DDD"
    )
    redacted = redact(detail)
    for secret in ("AAA", "BBB", "CCC", "DDD"):
        assert secret not in redacted
    assert redacted == (
        "request to https://crm.example/x?api_key=[redacted]&token=[redacted] with "
        "Authorization: [redacted] failed, password: [redacted]"
    )


@pytest.mark.parametrize(
    "detail",
    [
        "downstream answered 503",
        "no answer within the read timeout",
        "the tokenizer failed on line 3",
        "missing required field 'phone'",
        "could not connect to https://crm.example/tasks?page=2",
        "Bearer of bad news: the authorization server is down",
        "",
    ],
)
def test_ordinary_text_is_untouched(detail: str) -> None:
    """Text that quotes no credential comes back unchanged."""
    assert redact(detail) == detail


@pytest.mark.parametrize(
    ("detail", "secret"),
    [
        ('password="hunter2"', "hunter2"),
        ("token='abc123'", "abc123"),
        ('{"password": "hunter2"}', "hunter2"),
        ("{'api_key': 'sk_live_1'}", "sk_live_1"),
    ],
)
def test_quoted_credentials_are_redacted(detail: str, secret: str) -> None:
    """A credential whose value (or key) is quoted, as in JSON or a Python repr, is redacted."""
    assert secret not in redact(detail)


@pytest.mark.parametrize(
    ("detail", "secret"),
    [
        (
            "Authorization: Token 9944b09199c62bcf9418ad846dd0e4bb",
            "9944b09199c62bcf9418ad846dd0e4bb",
        ),
        ("Authorization: ApiKey sk_live_1", "sk_live_1"),
    ],
)
def test_credentials_after_other_authorization_schemes_are_redacted(
    detail: str, secret: str
) -> None:
    """The credential of an Authorization header is redacted whatever its scheme word."""
    assert secret not in redact(detail)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://crm.example/tasks?api_key=SECRETVALUE", "crm.example"),
        ("https://user:SECRETVALUE@crm.example:8443/t#SECRETVALUE", "crm.example:8443"),
        ("http://[::1]:9000/t?token=SECRETVALUE", "[::1]:9000"),
        ("not a url SECRETVALUE", "?"),
        ("http://crm.example:notaport/SECRETVALUE", "?"),
    ],
)
def test_a_route_url_is_shown_by_its_host_only(url: str, host: str) -> None:
    """Where a route's URL is shown (console, replay dry run), its userinfo, path, query and
    fragment, which may carry a credential, are left out."""
    from outbox.core.redaction import url_host

    assert url_host(url) == host
