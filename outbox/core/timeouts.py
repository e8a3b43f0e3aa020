"""Do the lease, the renewal, the action timeouts and the broker's redelivery fit together?

A worker holds a key for `lease_seconds` and renews it every third of that. An http action must
finish (connect plus read timeout) inside one lease: a call that cannot loses its lease every
time and never ends. One effect per key does not rest on this: the in-flight rule keeps everyone
else off a key until its lease's end plus the route's window (connect plus read timeout
plus `in_flight_margin_seconds`), however early a holder gave its lease up
(`outbox.core.inflight`). A route's window must also end well inside its retry deadline, or a
key whose request went unanswered would be out of time before anyone may look it up.

Redis hands an unacknowledged message to another worker after `visibility_timeout`; that must
be far above a lease plus its renewal, or the broker would redeliver a task that is still
running normally (RabbitMQ has no such timeout: it redelivers when the holder's connection
ends, so this rule is Redis's only). A configuration that breaks
either rule is refused at start-up, with the values named.
"""

from __future__ import annotations

from outbox.core import inflight
from outbox.core.broker import has_visibility_timeout
from outbox.core.routes import RouteTable
from outbox.core.settings import Settings

# How far above a lease plus one renewal interval the visibility timeout must be.
VISIBILITY_MARGIN = 2
# What a stopping worker needs after its last action may have started, beyond the lease and
# one renewal interval: a few seconds to record the outcome and acknowledge the message.
STOP_GRACE_MARGIN_SECONDS = 5


class TimingError(Exception):
    """The configured timings cannot keep one holder per key; the message names the values."""


def timing_problems(settings: Settings, routes: RouteTable) -> list[str]:
    """Every rule the settings break, in words an operator can act on."""
    problems = []
    lease = settings.lease_seconds
    renewal = lease / 3
    needed = VISIBILITY_MARGIN * (lease + renewal)
    if has_visibility_timeout(settings.broker()) and settings.visibility_timeout < needed:
        problems.append(
            f"VISIBILITY_TIMEOUT={settings.visibility_timeout} must be at least "
            f"{needed:g} s ({VISIBILITY_MARGIN} x (LEASE_SECONDS={lease} + renewal {renewal:g}))"
        )
    for route in routes.acting():
        if route.action_timeout_seconds >= lease:
            problems.append(
                f"route {route.label!r}: connect_timeout_seconds "
                f"({route.connect_timeout_seconds:g}) + read_timeout_seconds "
                f"({route.read_timeout_seconds:g}) must stay below LEASE_SECONDS={lease}, so "
                "that one call ends inside the lease that covers it"
            )
        in_flight = inflight.window(route, lease)
        if in_flight >= route.retry_deadline_seconds:
            problems.append(
                f"route {route.label!r}: its in-flight window ({in_flight:g} s: how long an "
                "unanswered request may still land, during which no one may act on its key) "
                f"must stay below retry_deadline_seconds ({route.retry_deadline_seconds:g})"
            )
    return problems


def minimum_stop_grace(lease_seconds: float) -> float:
    """The shortest time a supervisor should give a worker between SIGTERM and SIGKILL.

    A warm shutdown waits for the running attempt, which holds at most one lease (an http
    action's timeouts stay below it) and may have just renewed; killing it earlier cuts a call
    midway and leaves an uncertain outcome to reconcile."""
    return lease_seconds + lease_seconds / 3 + STOP_GRACE_MARGIN_SECONDS


def check_timing(settings: Settings, routes: RouteTable) -> None:
    """Raise TimingError naming every broken rule."""
    problems = timing_problems(settings, routes)
    if problems:
        raise TimingError("timings do not fit together: " + "; ".join(problems))
