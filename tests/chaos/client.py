"""The soak's clients: deliver every planned request on time from a pool of threads, record
every answer (status, timing, Retry-After, the key and state it reports), and come back
later after a 503 or a connection error, as a well-behaved provider would. With several
receivers, each request goes to the next one in turn, as behind a round-robin load balancer
without health checks: a retry meets the other receiver half of the time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from tests.chaos.plan import CONFLICT, Delivery

# A request that takes longer than this is a hang, whatever it returns.
CLIENT_TIMEOUT_SECONDS = 20.0
# An idle connection is dropped after this long, well before the receiver closes it (its
# keep-alive, KEEP_ALIVE_SECONDS, is 5 s): a request sent on a connection the server is closing
# fails without an answer (HTTP/1.1's keep-alive race), which says nothing of the gateway.
KEEPALIVE_EXPIRY_SECONDS = 2.0


@dataclass
class Answer:
    event: int
    kind: str
    started: float  # seconds since the start of the send phase
    elapsed: float
    status: int | None  # None: no HTTP answer (connection error, timeout)
    error: str = ""
    retry_after: str | None = None
    key: str | None = None
    duplicate: bool | None = None
    state: str | None = None
    external_ref: str | None = None
    error_code: str | None = None
    superseded_by: str | None = None
    # A fan-out event's answer: the keys of its deliveries, in the order listed.
    deliveries: list[str] | None = None
    receiver: str = ""  # the base URL of the receiver that was asked


class Scheduler:
    """Runs `deliver(delivery_id)` for each of `deliveries` at its planned time (relative to
    `start()`) on a pool of `threads` threads; a delivery may be put back for later
    (`requeue`) until it reports its final answer (`finished`)."""

    def __init__(
        self, deliveries: list[Delivery], threads: int, name: str, base_url: str | Sequence[str]
    ) -> None:
        self.deliveries = deliveries
        self.base_urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.base_url = self.base_urls[0]
        self._turn = itertools.count()
        self._heap: list[tuple[float, int, int]] = []  # (due, tiebreak, delivery id)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._pending = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._local = threading.local()
        self._stop = threading.Event()
        self._t0 = 0.0
        self._thread = threading.Thread(target=self._dispatch, name=f"{name}-plan", daemon=True)
        for i, delivery in enumerate(deliveries):
            self._push(delivery.at, i)

    def now(self) -> float:
        return time.monotonic() - self._t0

    @property
    def t0(self) -> float:
        """When sending started (`time.monotonic()`): the zero of `now()`."""
        return self._t0

    def start(self, t0: float | None = None) -> None:
        """Start sending; `t0` (a `time.monotonic()` value) shares another scheduler's clock."""
        self._t0 = time.monotonic() if t0 is None else t0
        self._thread.start()

    def _push(self, due: float, delivery_id: int) -> None:
        with self._lock:
            heapq.heappush(self._heap, (due, next(self._seq), delivery_id))
            self._pending += 1

    def outstanding(self) -> int:
        """Deliveries without a final answer yet (queued, retrying or in flight)."""
        with self._lock:
            return self._pending

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            due: list[int] = []
            with self._lock:
                now = self.now()
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                wait = self._heap[0][0] - now if self._heap else 0.05
            for delivery_id in due:
                self._pool.submit(self.deliver, delivery_id)
            self._stop.wait(min(max(wait, 0.0), 0.05))

    def receiver(self) -> str:
        """The receiver for the next request: each in turn."""
        with self._lock:
            return self.base_urls[next(self._turn) % len(self.base_urls)]

    def set_receivers(self, base_urls: Sequence[str]) -> None:
        """Send the next requests to `base_urls` only, as a load balancer does once a receiver
        is added or taken out of its rotation (requests already sent finish where they are)."""
        assert base_urls, "a rotation needs a receiver"
        with self._lock:
            self.base_urls = list(base_urls)

    def client(self, base_url: str, **options: Any) -> httpx.Client:
        """This thread's HTTP client for `base_url` (httpx clients are not shared between
        threads); `options` apply when it is first made."""
        clients: dict[str, httpx.Client] = self._local.__dict__.setdefault("clients", {})
        if base_url not in clients:
            options.setdefault("timeout", CLIENT_TIMEOUT_SECONDS)
            options.setdefault("limits", httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS))
            clients[base_url] = httpx.Client(base_url=base_url, **options)
        return clients[base_url]

    def drop_client(self, base_url: str) -> None:
        """Forget this thread's client for `base_url` after a transport error: a broken
        pooled connection should not be reused."""
        client: httpx.Client | None = self._local.__dict__.get("clients", {}).pop(base_url, None)
        if client is not None:
            client.close()

    def deliver(self, delivery_id: int) -> None:
        raise NotImplementedError

    def requeue(self, delivery_id: int, delay: float) -> None:
        with self._lock:
            heapq.heappush(self._heap, (self.now() + delay, next(self._seq), delivery_id))

    def finished(self, delivery_id: int) -> None:
        with self._lock:
            self._pending -= 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)


class Sender(Scheduler):
    """Posts `deliveries` to /v1/events at their planned times from `threads` threads; a 503
    or connection error is retried after Retry-After (or a second)."""

    def __init__(
        self, base_url: str | Sequence[str], deliveries: list[Delivery], threads: int = 24
    ) -> None:
        super().__init__(deliveries, threads, "client", base_url)
        self.answers: list[Answer] = []
        self.final: dict[int, Answer] = {}  # delivery id -> its final answer
        self.accepted: dict[int, threading.Event] = {
            d.event.index: threading.Event() for d in deliveries
        }

    def deliver(self, delivery_id: int) -> None:
        delivery = self.deliveries[delivery_id]
        event = delivery.event
        if delivery.kind == CONFLICT and not self.accepted[event.index].is_set():
            # The conflicting payload must come second, or it would be the first payload.
            self.requeue(delivery_id, 1.0)
            return
        started = self.now()
        base_url = self.receiver()
        answer = Answer(event.index, delivery.kind, started, 0.0, None, receiver=base_url)
        try:
            response = self.client(base_url).post("/v1/events", json=delivery.body)
        except httpx.HTTPError as error:
            answer.elapsed = self.now() - started
            answer.error = type(error).__name__
            self.answers.append(answer)
            self.drop_client(base_url)
            self.requeue(delivery_id, 1.0)
            return
        answer.elapsed = self.now() - started
        answer.status = response.status_code
        answer.retry_after = response.headers.get("retry-after")
        try:
            body: dict[str, Any] = response.json()
        except ValueError:
            body = {}
        answer.key = body.get("key")
        answer.duplicate = body.get("duplicate")
        answer.state = body.get("status")
        answer.external_ref = body.get("external_ref")
        answer.error_code = body.get("error")
        answer.superseded_by = body.get("superseded_by")
        if isinstance(body.get("deliveries"), list):
            answer.deliveries = [str(d.get("key")) for d in body["deliveries"]]
        self.answers.append(answer)
        if response.status_code == 503:
            try:
                delay = float(answer.retry_after or 1)
            except ValueError:
                delay = 1.0
            self.requeue(delivery_id, delay)
            return
        if 200 <= response.status_code < 300:
            self.accepted[event.index].set()
        self.final[delivery_id] = answer
        self.finished(delivery_id)
