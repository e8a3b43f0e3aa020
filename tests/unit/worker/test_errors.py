"""Unit tests for worker.errors: the one classifier of action failures, over exhaustive tables."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from worker.errors import (
    TRANSIENT_STATUS,
    ActionError,
    Failure,
    PermanentError,
    RequestInvalid,
    TransientError,
    classify,
    error_for_response,
    parse_retry_after,
)

REQUEST = httpx.Request("POST", "http://x")
# 37 seconds before the instant every HTTP-date example below names (RFC 9110, section 5.6.7).
NOW = datetime(1994, 11, 6, 8, 49, 0, tzinfo=UTC)
IMF_FIXDATE = "Sun, 06 Nov 1994 08:49:37 GMT"
RFC_850 = "Sunday, 06-Nov-94 08:49:37 GMT"
ASCTIME = "Sun Nov  6 08:49:37 1994"


# --- classify ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "transient", "error_code", "retry_after"),
    [
        # Raised on purpose by actions: code and retry_after pass through.
        (TransientError("crm_busy", "try later", retry_after=12.5), True, "crm_busy", 12.5),
        (TransientError(), True, "transient", None),
        (PermanentError("crm_rejected", "bad e-mail"), False, "crm_rejected", None),
        # httpx timeouts.
        (httpx.ConnectTimeout("t", request=REQUEST), True, "timeout_connect", None),
        (httpx.ReadTimeout("t", request=REQUEST), True, "timeout_read", None),
        (httpx.WriteTimeout("t", request=REQUEST), True, "timeout_write", None),
        (httpx.PoolTimeout("t", request=REQUEST), True, "timeout_pool", None),
        # httpx transport errors.
        (httpx.ConnectError("refused", request=REQUEST), True, "connect_refused", None),
        (httpx.RemoteProtocolError("eof", request=REQUEST), True, "connection_dropped", None),
        (httpx.ReadError("reset", request=REQUEST), True, "connection_dropped", None),
        (httpx.WriteError("broken pipe", request=REQUEST), True, "transport_error", None),
        (httpx.CloseError("close", request=REQUEST), True, "transport_error", None),
        (httpx.ProxyError("proxy", request=REQUEST), True, "transport_error", None),
        (httpx.LocalProtocolError("h11", request=REQUEST), False, "request_invalid", None),
        (httpx.TransportError("other", request=REQUEST), True, "transport_error", None),
        # A URL that can never work is a configuration error, not worth a retry.
        (httpx.InvalidURL("no host"), False, "configuration", None),
        pytest.param(
            httpx.UnsupportedProtocol("ftp://x", request=REQUEST),
            False,
            "configuration",
            None,
            id="UnsupportedProtocol",
        ),
        # Anything else: a bug or a blip, bounded by the attempt budget.
        (ValueError("boom"), True, "unexpected_error", None),
        (KeyError("k"), True, "unexpected_error", None),
        (RuntimeError(), True, "unexpected_error", None),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)
def test_classify(
    error: BaseException, transient: bool, error_code: str, retry_after: float | None
) -> None:
    """classify turns every exception into a Failure with the right kind, code and retry_after."""
    failure = classify(error)
    assert isinstance(failure, Failure)
    assert failure.transient is transient
    assert failure.error_code == error_code
    assert failure.retry_after == retry_after


def test_classify_keeps_action_detail() -> None:
    """The detail an action gives its error reaches the Failure unchanged."""
    assert classify(PermanentError("c", "the detail")).detail == "the detail"
    assert classify(TransientError("c", "other detail")).detail == "other detail"


def test_classify_names_unexpected_exception_type() -> None:
    """An unexpected exception's detail is its type name, never its (possibly secret) message."""
    failure = classify(ValueError("password=hunter2"))
    assert failure.detail == "ValueError"
    assert "hunter2" not in failure.detail


def test_action_errors_share_a_base() -> None:
    """TransientError and PermanentError are ActionErrors carrying an error_code."""
    for error in (TransientError("a"), PermanentError("b")):
        assert isinstance(error, ActionError)
    assert PermanentError("code_only").error_code == "code_only"
    assert str(PermanentError("code_only")) == "code_only"


# --- error_for_response -----------------------------------------------------------------------


def response(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, headers=headers or {}, request=REQUEST)


def fixed_now() -> datetime:
    return NOW


@pytest.mark.parametrize("status", [200, 201, 202, 203, 204, 299])
def test_success_is_no_error(status: int) -> None:
    """Every 2xx answer means success: no error."""
    assert error_for_response(response(status)) is None


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504, 501, 505, 599])
def test_transient_statuses(status: int) -> None:
    """408, 425, 429 and every 5xx are TransientError http_NNN."""
    error = error_for_response(response(status))
    assert isinstance(error, TransientError)
    assert error.error_code == f"http_{status}"
    assert error.retry_after is None
    assert classify(error).transient is True


@pytest.mark.parametrize(
    "status", [400, 401, 403, 404, 405, 409, 410, 411, 413, 415, 422, 451, 499]
)
def test_permanent_statuses(status: int) -> None:
    """Other 4xx answers are PermanentError http_NNN: retrying cannot help."""
    error = error_for_response(response(status))
    assert isinstance(error, PermanentError)
    assert error.error_code == f"http_{status}"
    assert classify(error).transient is False


def test_transient_status_set_is_the_documented_one() -> None:
    """The transient set is exactly invariant 5's list (plus every other 5xx by rule)."""
    assert frozenset({408, 425, 429, 500, 502, 503, 504}) == TRANSIENT_STATUS


@pytest.mark.parametrize(
    ("status", "retry_after", "expected"),
    [
        (429, "2", 2.0),
        (503, "0", 0.0),
        (503, " 120 ", 120.0),
        (429, IMF_FIXDATE, 37.0),
        (503, RFC_850, 37.0),
        (503, ASCTIME, 37.0),
        (429, "Sat, 05 Nov 1994 08:49:37 GMT", 0.0),  # in the past
        (503, "soon", None),
        (503, "", None),
        (503, "-5", None),
        (503, "1.5", None),
    ],
)
def test_retry_after_on_transient_response(
    status: int, retry_after: str, expected: float | None
) -> None:
    """A transient answer carries Retry-After in seconds, from delta-seconds or an HTTP-date."""
    error = error_for_response(response(status, {"Retry-After": retry_after}), now=fixed_now)
    assert isinstance(error, TransientError)
    assert error.retry_after == expected
    assert classify(error).retry_after == expected


def test_retry_after_ignored_on_permanent_response() -> None:
    """A permanent answer never schedules a retry, whatever its Retry-After says."""
    error = error_for_response(response(400, {"Retry-After": "2"}), now=fixed_now)
    assert isinstance(error, PermanentError)
    assert not hasattr(error, "retry_after")


# --- parse_retry_after ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("2", 2.0),
        ("0", 0.0),
        ("007", 7.0),
        ("86400", 86400.0),
        ("\t3 ", 3.0),
        (IMF_FIXDATE, 37.0),
        (RFC_850, 37.0),
        (ASCTIME, 37.0),
        ("Sun, 06 Nov 1994 09:49:37 GMT", 3637.0),
        ("Sun, 06 Nov 1994 08:49:00 GMT", 0.0),  # exactly now
        ("Sun, 06 Nov 1994 08:48:00 GMT", 0.0),  # in the past
        ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0),
        ("garbage", None),
        ("", None),
        ("   ", None),
        ("-1", None),
        ("2.5", None),
        ("1e3", None),
        ("2 seconds", None),
        ("Sun, 06 Nov 99999 08:49:37 GMT", None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    """parse_retry_after reads delta-seconds and all three HTTP-date formats, else None."""
    assert parse_retry_after(value, NOW) == expected


@pytest.mark.parametrize("date_format", [IMF_FIXDATE, RFC_850, ASCTIME])
def test_http_date_is_relative_to_injected_now(date_format: str) -> None:
    """An HTTP-date is measured from the injected `now`, not from the machine's clock."""
    earlier = NOW - timedelta(minutes=1)
    assert parse_retry_after(date_format, earlier) == 97.0


def test_non_ascii_digit_retry_after_is_none() -> None:
    """A Retry-After of non-ASCII 'digits' (a latin-1 b'\\xb2' header is '²') is garbage: None."""
    headers = httpx.Headers([(b"retry-after", b"\xb2")])
    assert parse_retry_after(headers["retry-after"], NOW) is None


# --- uncertainty ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "uncertain"),
    [
        (httpx.ReadTimeout("t", request=REQUEST), True),
        (httpx.WriteTimeout("t", request=REQUEST), True),
        (httpx.RemoteProtocolError("t", request=REQUEST), True),
        (httpx.ReadError("t", request=REQUEST), True),
        (httpx.ProxyError("t", request=REQUEST), True),
        (RuntimeError("boom"), True),
        (httpx.ConnectTimeout("t", request=REQUEST), False),
        (httpx.ConnectError("t", request=REQUEST), False),
        (httpx.PoolTimeout("t", request=REQUEST), False),
        (TransientError("busy"), False),
        (TransientError("maybe", uncertain=True), True),
        (PermanentError("http_422"), False),
    ],
)
def test_classify_says_whether_the_effect_may_exist(error: Exception, uncertain: bool) -> None:
    """Failures after the request may have reached the downstream are uncertain; failures
    before it (or a downstream's refusal) are not."""
    assert classify(error).uncertain is uncertain


@pytest.mark.parametrize(
    ("status", "uncertain"),
    [
        *[(status, True) for status in (500, 502, 504, 501, 599)],
        *[(status, False) for status in (408, 425, 429, 503, 400, 422)],
    ],
)
def test_server_errors_other_than_503_leave_the_effect_uncertain(
    status: int, uncertain: bool
) -> None:
    """A 500, 502 or 504 may come after the work was done; 408, 425, 429, 503 and 4xx refuse."""
    error = error_for_response(response(status), fixed_now)
    assert error is not None and classify(error).uncertain is uncertain


@pytest.mark.parametrize(
    ("error", "at_downstream"),
    [
        (httpx.ConnectError("t", request=REQUEST), True),
        (httpx.ReadTimeout("t", request=REQUEST), True),
        (TransientError("http_503"), True),
        (RuntimeError("boom"), True),
        (TransientError("lease_lost"), False),
        (httpx.PoolTimeout("t", request=REQUEST), False),
        (httpx.LocalProtocolError("h11", request=REQUEST), False),
        (httpx.InvalidURL("no host"), False),
        (RequestInvalid("a header is not ASCII"), False),
        (PermanentError("http_422"), False),
    ],
)
def test_only_failures_at_the_downstream_are_the_routes(
    error: Exception, at_downstream: bool
) -> None:
    """The breaker counts transient failures the downstream (or the way to it) caused; an error
    raised on our side before anything was sent is the key's own (`local`) and never counted."""
    failure = classify(error)
    assert failure.at_downstream is at_downstream
    if isinstance(error, RequestInvalid | httpx.LocalProtocolError | httpx.InvalidURL):
        assert failure.local and not failure.transient
