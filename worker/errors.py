"""What went wrong in an action, and whether trying again can help.

    Exception raised by an action or its HTTP client
     ├── ActionError                    (raised on purpose by actions)
     │    ├── TransientError            retry later (optionally not before `retry_after`, and
     │    │                             only within `window_seconds` of the first failure)
     │    ├── InProgress                the downstream is already running this key: wait
     │    │                             `retry_after` and ask again, spending no attempt
     │    └── PermanentError            retrying cannot help: dead letter now
     │         └── RequestInvalid       the request could not be built here (a header that
     │                                  is not ASCII, a body that is not JSON): nothing sent
     ├── httpx.TimeoutException         transient: timeout_connect / timeout_read / ...
     ├── httpx.LocalProtocolError       permanent `request_invalid`: refused on our side
     ├── httpx.TransportError           transient: connect_refused / connection_dropped / ...
     └── anything else                  transient `unexpected_error` (a bug or a blip; the
                                        attempt budget bounds it)

`classify` is the one boundary where foreign errors become a `Failure`; task code never looks
at a status code or an exception type. `error_for_response` reads an HTTP answer, knowing the
route's kind of downstream:

    any route   409 {"idem": "in_progress", "retry_after": N}: the Idem Trigger node
    (docs/how-to/n8n.md,
                "The trigger's answers") has this key's execution running: `in_progress`, a
                wait (`Failure.wait`) that spends no attempt and is never told to the breaker
    any route   500 {"idem": "failed", "retryable": true, "error_code", "effect"}: the Idem
                Trigger's workflow failed and its claim was freed: transient with that error
                code, uncertain unless `effect` is "none"; `retryable: false`, permanent
    kind n8n    404 whose JSON `message` says the webhook "is not registered" (n8n answers so
                while a workflow is being published and while it starts): transient
                `n8n_webhook_not_registered`, not uncertain (nothing ran), for
                `n8n_unregistered_grace_seconds` after the key's first failure; past that,
                permanent. Told to the breaker like any transient failure: a re-publish fails
                every key at once, and a short open circuit spares n8n while it comes back.
                The same for n8n's answers while it starts: 200 "n8n is starting up. Please
                wait" (never a success) and Express's HTML 404 "Cannot POST /webhook/..."

Each failure also says whether the effect may exist (`uncertain`): the request may have reached
the downstream and done its work although no success came back. Uncertain:

    timeout_read, timeout_write        the request was (being) sent; the answer never came
    connection_dropped, transport_error the connection broke after it was open
    http_500, http_502, http_504       a server or proxy may answer so after the work was done
    other 5xx except 503               unknown server errors, treated like 500
    action_timeout                     the action ran past its route's time limit
    python_exception, unexpected_error an exception we did not expect, after who knows what
    TransientError(uncertain=True)     an action's own word

Not uncertain (the downstream did not act): timeout_connect, connect_refused, timeout_pool,
http_408, http_425, http_429, http_503, and an action's TransientError by default. A lost or
expired lease makes the key uncertain at the next claim (`outbox.store.lifecycle.CLAIM_KEY`).

And whether the request never reached anything that could act on it (`not_sent`): no connection
was made (`connect_refused`: refused, unreachable, a name that does not resolve, a TLS handshake
that failed; `timeout_connect`), or n8n said no workflow listens on the path
(`n8n_webhook_not_registered`), or an action's `TransientError(not_sent=True)`. Such a failure
spends no attempt (`worker.outcomes`): a downstream that restarts or is being deployed costs its
keys nothing but time, bounded by the route's `retry_deadline_seconds`.

And whether the failure is the key's own, raised on our side before anything was sent
(`local`): `request_invalid`, `configuration` and `timeout_pool`. The route's breaker never
hears of those; a downstream that never saw the request cannot be judged by it.
"""

from __future__ import annotations

import email.utils
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import httpx

TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# Answers that refuse the request before any work: the downstream says it did nothing.
REFUSED_STATUS = frozenset({408, 425, 429, 503})
N8N_NOT_REGISTERED = "n8n_webhook_not_registered"
IN_PROGRESS = "in_progress"
# The Idem Trigger's answer for a failed workflow, and the error code when it names none usable.
TRIGGER_FAILED = "failed"
TRIGGER_FAILED_CODE = "n8n_workflow_failed"
_ERROR_CODE = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
# What n8n answers a webhook while it starts (`_n8n_starting`).
N8N_STARTING_TEXT = b"n8n is starting up. Please wait"
_CANNOT_POST = re.compile(rb"<pre>Cannot [A-Z]+ /[^<]*</pre>")
# An "in progress" answer without a usable retry_after: ask again in five seconds, a few
# rounds within a provider's webhook timeout; never sooner than a second, so a trigger that
# answers 0 is not asked in a tight loop.
IN_PROGRESS_DEFAULT_SECONDS = 5.0
IN_PROGRESS_MIN_SECONDS = 1.0
# Bodies larger than this are not read for n8n's or the trigger's answers (both are tiny).
_MAX_ANSWER_BYTES = 4096


class ActionError(Exception):
    """Base of the errors an action raises on purpose."""

    def __init__(
        self,
        error_code: str,
        detail: str = "",
        *,
        uncertain: bool = False,
        status_code: int | None = None,
    ) -> None:
        super().__init__(detail or error_code)
        self.error_code = error_code
        self.detail = detail
        # The effect may exist although the action failed (see the table above).
        self.uncertain = uncertain
        # The downstream's HTTP status when it answered (the attempt log shows it).
        self.status_code = status_code


class TransientError(ActionError):
    """Worth another attempt; `retry_after` (seconds) is the earliest the downstream wants one."""

    def __init__(
        self,
        error_code: str = "transient",
        detail: str = "",
        *,
        retry_after: float | None = None,
        uncertain: bool = False,
        window_seconds: float | None = None,
        status_code: int | None = None,
        not_sent: bool = False,
    ) -> None:
        super().__init__(error_code, detail, uncertain=uncertain, status_code=status_code)
        self.retry_after = retry_after
        # Transient only this long after the key's first failure; past it, permanent.
        self.window_seconds = window_seconds
        # The request never reached anything that could act on it: no attempt is spent.
        self.not_sent = not_sent and not uncertain


class InProgress(ActionError):
    """The downstream runs this key already and asks to be asked again after `retry_after`
    seconds: a wait, not a failure (no attempt spent, nothing told to the breaker)."""

    def __init__(self, retry_after: float, detail: str = "") -> None:
        super().__init__(
            IN_PROGRESS, detail or "the downstream is running this key", status_code=409
        )
        self.retry_after = retry_after


class PermanentError(ActionError):
    """Retrying cannot help (bad request, refused credentials, invalid data)."""


class RequestInvalid(PermanentError):
    """The request could not be built on our side; nothing was sent."""

    def __init__(self, detail: str) -> None:
        super().__init__("request_invalid", detail)


@dataclass(frozen=True)
class Failure:
    """A classified failure: the code goes to the key row, the logs and the metrics."""

    transient: bool
    error_code: str
    detail: str
    retry_after: float | None = None
    # The effect may have happened although the attempt failed.
    uncertain: bool = False
    # Raised on our side before anything reached the downstream: the key's own failure.
    local: bool = False
    # Not a failure: the downstream asked to be asked again after `retry_after` (no attempt).
    wait: bool = False
    # Transient only this long after the key's first failure; past it, permanent.
    window_seconds: float | None = None
    # The downstream's HTTP status, when it answered.
    status_code: int | None = None
    # Nothing that could act received the request (module docstring): it spends no attempt.
    not_sent: bool = False

    @property
    def at_downstream(self) -> bool:
        """A transient failure the downstream (or the way to it) caused: what the breaker counts."""
        return (
            self.transient and not self.local and not self.wait and self.error_code != "lease_lost"
        )


def classify(error: BaseException) -> Failure:
    """Turn any exception from an action into a Failure (with the downstream's status code
    when it answered)."""
    failure = _classified(error)
    if isinstance(error, ActionError) and error.status_code is not None:
        return replace(failure, status_code=error.status_code)
    return failure


def _classified(error: BaseException) -> Failure:
    match error:
        case RequestInvalid():
            return Failure(False, error.error_code, error.detail, local=True)
        case TransientError():
            return Failure(
                True,
                error.error_code,
                error.detail,
                error.retry_after,
                error.uncertain,
                window_seconds=error.window_seconds,
                not_sent=error.not_sent,
            )
        case InProgress():
            return Failure(True, error.error_code, error.detail, error.retry_after, wait=True)
        case PermanentError():
            return Failure(False, error.error_code, error.detail, None, error.uncertain)
        case httpx.ConnectTimeout():
            return Failure(True, "timeout_connect", "connecting timed out", not_sent=True)
        case httpx.ReadTimeout():
            return Failure(True, "timeout_read", "no answer within the read timeout", None, True)
        case httpx.WriteTimeout():
            return Failure(True, "timeout_write", "sending the request timed out", None, True)
        case httpx.PoolTimeout():
            return Failure(
                True, "timeout_pool", "no free connection in the client pool", local=True
            )
        case httpx.ConnectError():
            # Raised only while the connection is being made (TCP, name lookup, TLS
            # handshake), before a byte of the request is written.
            return Failure(True, "connect_refused", "could not connect", not_sent=True)
        case httpx.LocalProtocolError():
            detail = "the HTTP client refused to send the request as built"
            return Failure(False, "request_invalid", detail, local=True)
        case httpx.RemoteProtocolError() | httpx.ReadError():
            return Failure(
                True, "connection_dropped", "the connection closed mid-response", None, True
            )
        # Before TransportError, of which UnsupportedProtocol is a subclass: a URL that can
        # never work is not worth a retry.
        case httpx.InvalidURL() | httpx.UnsupportedProtocol():
            return Failure(False, "configuration", "the route's URL is invalid", local=True)
        case httpx.TransportError():
            return Failure(True, "transport_error", type(error).__name__, None, True)
        case _:
            return Failure(True, "unexpected_error", type(error).__name__, None, True)


def error_for_response(
    response: httpx.Response,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    *,
    kind: str = "generic",
    n8n_grace_seconds: float = 300.0,
) -> ActionError | None:
    """The error a non-2xx answer stands for, or None for success. `kind` is the route's kind
    of downstream (`generic` or `n8n`), `n8n_grace_seconds` its window for n8n's "webhook not
    registered" (module docstring)."""
    status = response.status_code
    if kind == "n8n" and _n8n_starting(response):
        return TransientError(
            N8N_NOT_REGISTERED,
            f"n8n answered {status} while starting: its webhooks are not registered yet",
            window_seconds=n8n_grace_seconds,
            status_code=status,
            not_sent=True,
        )
    if 200 <= status < 300:
        return None
    code = f"http_{status}"
    if status == 409:
        answer = _small_json(response)
        if isinstance(answer, dict) and answer.get("idem") == IN_PROGRESS:
            return InProgress(
                _wait_seconds(answer.get("retry_after"), response, now()),
                "the Idem Trigger is running this key's execution",
            )
    if failed := _trigger_failed(response):
        return failed
    if status == 404 and kind == "n8n" and _n8n_not_registered(_small_json(response)):
        return TransientError(
            N8N_NOT_REGISTERED,
            "n8n answered 404: the workflow's webhook is not registered (being published, "
            "or n8n is starting)",
            window_seconds=n8n_grace_seconds,
            status_code=404,
            not_sent=True,
        )
    if status in TRANSIENT_STATUS or status >= 500:
        retry_after = parse_retry_after(response.headers.get("retry-after"), now())
        return TransientError(
            code,
            f"downstream answered {status}",
            retry_after=retry_after,
            uncertain=status not in REFUSED_STATUS,
            status_code=status,
        )
    return PermanentError(code, f"downstream answered {status}", status_code=status)


def _trigger_failed(response: httpx.Response) -> ActionError | None:
    """The Idem Trigger's answer for a workflow that failed (docs/how-to/n8n.md, "The trigger's
    answers"), classified as the trigger says; None for any other answer."""
    if response.status_code < 400:
        return None
    answer = _small_json(response)
    if not isinstance(answer, dict) or answer.get("idem") != TRIGGER_FAILED:
        return None
    given = answer.get("error_code")
    code = given if isinstance(given, str) and _ERROR_CODE.fullmatch(given) else TRIGGER_FAILED_CODE
    detail = f"the Idem Trigger's workflow failed ({response.status_code})"
    if answer.get("retryable") is False:
        return PermanentError(code, detail, status_code=response.status_code)
    return TransientError(
        code,
        detail,
        uncertain=answer.get("effect") != "none",
        status_code=response.status_code,
    )


def _n8n_starting(response: httpx.Response) -> bool:
    """n8n's answers between opening its port and registering its webhook routes (n8n 2.x
    `AbstractServer`): `200 n8n is starting up. Please wait` while its database migrates, and
    Express's own `404 Cannot POST /webhook/...` (HTML) until the routes exist. Neither ran a
    workflow; the 200 must never read as a success."""
    content = response.content
    if not content or len(content) > _MAX_ANSWER_BYTES:
        return False
    if response.status_code == 200:
        return content.strip() == N8N_STARTING_TEXT
    return response.status_code == 404 and _CANNOT_POST.search(content) is not None


def _small_json(response: httpx.Response) -> object:
    """The answer's JSON when it is small enough to be one of the answers read here."""
    content = response.content
    if not content or len(content) > _MAX_ANSWER_BYTES:
        return None
    try:
        return json.loads(content)
    except ValueError:
        return None


def _n8n_not_registered(answer: object) -> bool:
    """n8n's answer for a webhook path no active workflow listens on:
    `{"code": 404, "message": "The requested webhook \"POST path\" is not registered.", ...}`."""
    if not isinstance(answer, dict):
        return False
    message = answer.get("message")
    return (
        isinstance(message, str)
        and message.startswith("The requested webhook")
        and "is not registered" in message
    )


def _wait_seconds(given: object, response: httpx.Response, now: datetime) -> float:
    """The trigger's `retry_after` (seconds), else the Retry-After header, else the default;
    never below a second."""
    seconds: float | None = None
    if isinstance(given, int | float) and not isinstance(given, bool) and 0 <= given < math.inf:
        seconds = float(given)
    else:
        seconds = parse_retry_after(response.headers.get("retry-after"), now)
    if seconds is None:
        seconds = IN_PROGRESS_DEFAULT_SECONDS
    return max(IN_PROGRESS_MIN_SECONDS, seconds)


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP-date (RFC 9110)."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())
