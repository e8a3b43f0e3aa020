"""The database's state as Prometheus metrics, read on each scrape of the gateway's /metrics.

State (keys by status, backlog, lag, dead letters, duplicates, reclaimed leases) is read from
the database at scrape time, so every replica reports the same truth and nothing is lost when a
process restarts. No scrape reads every key (see `stats.collect`): on a large table the
succeeded count is an estimate, and `idem_keys_estimated` says so.

What only the receiver sees (accepted events, payload conflicts) is counted in the process
(`outbox.ingest.metrics`); the app (`outbox.app`) serves both from one registry. Workers serve
their own counters (attempt outcomes, action latency) from Celery's prefork children through
prometheus-client's multiprocess mode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from outbox.core.logs import get_logger
from outbox.core.routes import RouteTable
from outbox.operate import routestate, stats

log = get_logger(__name__)


class DatabaseCollector(Collector):
    """Reads the key store's state on each scrape."""

    def __init__(self, engine: Callable[[], Engine], routes: RouteTable) -> None:
        self._engine = engine
        self._routes = routes

    def collect(self) -> Iterable[Metric]:
        try:
            now = stats.collect(self._engine(), self._routes.destinations)
        except Exception as error:
            log.warning("metrics.database_unavailable", error=type(error).__name__)
            up = GaugeMetricFamily("idem_database_up", "Whether the last scrape reached it.")
            up.add_metric([], 0)
            yield up
            return
        up = GaugeMetricFamily("idem_database_up", "Whether the last scrape reached it.")
        up.add_metric([], 1)
        yield up
        keys = GaugeMetricFamily("idem_keys", "Keys by status.", labels=["status"])
        for status, count in now["keys_by_status"].items():
            keys.add_metric([status], count)
        yield keys
        estimated = GaugeMetricFamily(
            "idem_keys_estimated",
            "1 where idem_keys is estimated (succeeded, fanned_out: above 100 000 keys), 0 "
            "where it is counted.",
            labels=["status"],
        )
        estimated.add_metric(["succeeded"], int(now["keys_succeeded_estimated"]))
        estimated.add_metric(["fanned_out"], int(now["keys_fanned_out_estimated"]))
        yield estimated
        yield from destination_metrics(now["destinations"], set(self._routes.destinations))
        backlog = GaugeMetricFamily("idem_outbox_backlog", "Unpublished outbox rows due now.")
        backlog.add_metric([], now["outbox"]["due"])
        yield backlog
        lag = GaugeMetricFamily(
            "idem_outbox_lag_seconds", "Age of the oldest due, unpublished outbox row."
        )
        lag.add_metric([], now["outbox"]["oldest_due_age_seconds"])
        yield lag
        processing = GaugeMetricFamily("idem_processing", "Keys being processed.")
        processing.add_metric([], now["processing"]["count"])
        yield processing
        oldest = GaugeMetricFamily(
            "idem_processing_oldest_age_seconds", "Age of the oldest key in processing."
        )
        oldest.add_metric([], now["processing"]["oldest_age_seconds"])
        yield oldest
        dead = GaugeMetricFamily(
            "idem_dead_letters_open", "Open dead letters by kind.", labels=["kind"]
        )
        for kind, count in now["open_dead_letters"].items():
            dead.add_metric([kind], count)
        yield dead
        blocked = CounterMetricFamily(
            "idem_duplicates_blocked",
            "Repeats answered without a second action, by where they were stopped.",
            labels=["where"],
        )
        for where, count in now["duplicates_blocked"].items():
            blocked.add_metric([where], count)
        yield blocked
        reclaimed = CounterMetricFamily(
            "idem_leases_reclaimed", "Claims that took over an expired lease."
        )
        reclaimed.add_metric([], now["leases_reclaimed"])
        yield reclaimed
        try:
            families = list(route_metrics(self._engine(), self._routes))
        except Exception as error:  # the key metrics above still count
            log.warning("metrics.routes_unavailable", error=type(error).__name__)
            families = []
        yield from families


CIRCUIT_STATES = ("closed", "open", "half_open", "paused")


def destination_metrics(
    destinations: dict[str, dict[str, int]], configured: set[str]
) -> Iterable[Metric]:
    """Each destination's deliveries by status (those not yet succeeded) and its open dead
    letters; a destination no longer configured is counted as `other`."""
    keys = GaugeMetricFamily(
        "idem_destination_keys",
        "A destination's deliveries on their way or failed, by status.",
        labels=["destination", "status"],
    )
    dead = GaugeMetricFamily(
        "idem_destination_dead_letters_open",
        "A destination's open dead letters.",
        labels=["destination"],
    )
    merged: dict[str, Counter[str]] = {}
    for name, counts in destinations.items():
        merged.setdefault(name if name in configured else "other", Counter()).update(counts)
    for name, counts in sorted(merged.items()):
        for status in stats.DESTINATION_COUNTS:
            keys.add_metric([name, status], counts[status])
        dead.add_metric([name], counts["open_dead_letters"])
    yield keys
    yield dead


def route_metrics(engine: Engine, routes: RouteTable) -> Iterable[Metric]:
    """Each configured route's and destination's state (one-hot; `paused` beside the
    circuit) and its attempts running now (keys holding a live lease), from the shared route
    state. A fan-out route has neither: it runs nothing itself."""
    state = GaugeMetricFamily(
        "idem_route_state",
        "A route's state: 1 for its circuit (closed, open, half_open) and for paused.",
        labels=["route", "state"],
    )
    in_flight = GaugeMetricFamily(
        "idem_route_in_flight", "Attempts running now for the route.", labels=["route"]
    )
    for item in routestate.list_routes(engine, routes):
        if item["kind"] == "fan_out":
            continue  # it runs nothing: its destinations have the state
        for name in CIRCUIT_STATES:
            on = item["paused"] if name == "paused" else item["circuit"] == name
            state.add_metric([item["name"], name], 1 if on else 0)
        in_flight.add_metric([item["name"]], item["in_flight"])
    yield state
    yield in_flight
