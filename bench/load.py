"""The load generator, run in a process of its own: `python -m bench.load SPEC_JSON`.

N keep-alive HTTP/1.1 connections driven by one asyncio loop. Closed loop: each connection
sends its next request as soon as the previous one is answered. Open loop (`rate`): requests
start on a fixed schedule whatever the answers, each on the next free connection; latency counts
from the scheduled start, so a stalled server is not hidden by the generator waiting for it.
Every request is new (a fresh external_id or claim key) except in `duplicates`, which repeats
known ids. Prints one JSON line: counts, rate, latency percentiles, the generator's CPU time.

Two clients: `raw` (default), a minimal HTTP/1.1 client on asyncio streams (about 0.1 ms of
CPU per request here), and `httpx`, one `httpx.AsyncClient` per connection. httpx costs 1.3 to
1.5 ms of CPU per request on this 2-core machine, and more than 10 ms with one shared pool of
64 connections (httpcore's pool does work per queued request on every change), so with httpx
the generator, not the server, is what a run measures. See docs/explanation/performance.md.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import resource
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from bench.procfs import machine_busy_seconds, tree_cpu_seconds
from outbox.ingest.provider_signatures import sign_stripe

EVENT = (
    '{{"source":"{source}","event_type":"{event_type}","external_id":"{external_id}",'
    '"payload":{{"email":"{external_id}@example.com","name":"Ada","amount":42}}}}'
)
# A Stripe-style event (the shape of Stripe's event objects), posted to /v1/webhooks/stripe.
STRIPE_EVENT = (
    '{{"id":"evt_{source}_{external_id}","object":"event","api_version":"2024-06-20",'
    '"created":1800000000,"type":"invoice.paid","livemode":false,"pending_webhooks":1,'
    '"data":{{"object":{{"id":"in_{external_id}","object":"invoice","amount_paid":4200,'
    '"currency":"eur","customer":"cus_{external_id}","status":"paid"}}}}}}'
)
# An update of a business object (a CRM contact): the lane is the contact, the version grows by
# one per event of that contact. Shaped like EVENT (the same members, plus the contact).
LANE_EVENT = (
    '{{"source":"{source}","event_type":"{event_type}","external_id":"{external_id}",'
    '"version":{version},"payload":{{"contact":{{"id":"{external_id}","version":{version}}},'
    '"email":"{external_id}@example.com","name":"Ada","amount":42}}}}'
)
CLAIM = (
    '{{"key":"{source}-{external_id}","payload":{{"order":"{external_id}"}},"lease_seconds":60}}'
)
MODES = {
    # mode: (path, body template, answers counted as success)
    "events": ("/v1/events", EVENT, (202,)),
    "duplicates": ("/v1/events", EVENT, (200, 202)),
    "claims": ("/v1/claims", CLAIM, (201,)),
    "naive": ("/events", EVENT, (202,)),
    # Updates of `lanes` contacts, each contact's versions 1, 2, 3 ... in the order sent.
    "lanes": ("/v1/events", LANE_EVENT, (202,)),
    # Signed with Stripe's scheme (`secret`); ids carry `source`, so a run's events can be
    # counted afterwards (events.external_id is the event id).
    "stripe": ("/v1/webhooks/stripe", STRIPE_EVENT, (202,)),
}


@dataclass
class Spec:
    url: str
    mode: str = "events"
    concurrency: int = 16
    duration: float = 3.0
    warmup: float = 0.0
    # Open loop: requests per second (0: closed loop).
    rate: float = 0.0
    # The `source` member: lets a run's keys be found in the database afterwards.
    source: str = "bench"
    # duplicates: external ids 0 .. known-1 were posted before with source `source`.
    known: int = 0
    # Stop after this many requests (0: the duration alone bounds the run; open loop: the
    # number of requests scheduled, `duration` * `rate` by default).
    limit: int = 0
    client: str = "raw"
    # Closed loop: post external ids 0, 1, 2 ... in order (to pre-create known keys).
    sequential_ids: bool = False
    # Processes whose CPU time is read before and after the timed part (the server).
    watch_pids: list[int] = field(default_factory=list)
    # stripe: the source's signing secret.
    secret: str = ""
    # lanes: how many contacts (lanes) the updates fall on, picked at random per request.
    lanes: int = 0
    # events and lanes: the event type, which the routes file maps to a route (empty: the
    # mode's own, `bench.noop` for events, `bench.contact.updated` for lanes).
    event_type: str = ""


@dataclass
class Result:
    requests: int = 0
    ok: int = 0
    errors: int = 0
    elapsed: float = 0.0
    rate: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    # Requests sent during the warm-up before the timed part (not counted above).
    warmup_requests: int = 0
    cpu_seconds: float = 0.0
    # CPU time of the watched processes (and their children) during the timed part.
    server_cpu_seconds: float = 0.0
    # Busy CPU time of the whole machine during the timed part (every process, anyone's).
    machine_busy_seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


Headers = dict[str, str]


class Client(Protocol):
    async def post(self, path: str, body: bytes, headers: Headers) -> int: ...

    async def close(self) -> None: ...


class RawClient:
    """One keep-alive HTTP/1.1 connection: request bytes out, status line and body in."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: Headers) -> int:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"%scontent-length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), self.port, extra, len(body), body)
        )
        try:
            return await self._response(self.reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            await self.close()
            raise

    async def _response(self, reader: asyncio.StreamReader) -> int:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        at = lower.find(b"\r\ncontent-length:")
        if at >= 0:
            await reader.readexactly(int(head[at + 17 : head.index(b"\r\n", at + 2)]))
        elif b"\r\ntransfer-encoding: chunked" in lower:
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        if b"\r\nconnection: close" in lower:
            await self.close()
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class HttpxClient:
    """One httpx.AsyncClient holding one connection (a shared pool is far slower, see above)."""

    def __init__(self, url: str) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        self.client = httpx.AsyncClient(base_url=url, limits=limits, timeout=60)

    async def post(self, path: str, body: bytes, headers: Headers) -> int:
        response = await self.client.post(
            path, content=body, headers={"content-type": "application/json", **headers}
        )
        return response.status_code

    async def close(self) -> None:
        await self.client.aclose()


class Bodies:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.template = MODES[spec.mode][1]
        self.tag = uuid.uuid4().hex[:10]
        self.counter = 0
        # lanes: the last version sent of each contact.
        self.versions: Counter[int] = Counter()

    def next(self) -> tuple[bytes, Headers]:
        self.counter += 1
        if self.spec.mode == "lanes":
            return self._lane_update(), {}
        if self.spec.mode == "duplicates":
            external_id = str(random.randrange(self.spec.known))
        elif self.spec.sequential_ids:
            external_id = str(self.counter - 1)
        else:
            external_id = f"{self.tag}-{self.counter}"
        body = self.template.format(
            source=self.spec.source,
            external_id=external_id,
            event_type=self.spec.event_type or "bench.noop",
        ).encode()
        if self.spec.mode == "stripe":
            return body, {"stripe-signature": sign_stripe(self.spec.secret, int(time.time()), body)}
        return body, {}

    def _lane_update(self) -> bytes:
        """The next version of a contact picked at random; the contact ids carry this
        generator's tag, so each run's lanes are its own (a later run's version 1 would
        otherwise be older than what an earlier run applied)."""
        contact = random.randrange(max(1, self.spec.lanes))
        self.versions[contact] += 1
        return self.template.format(
            source=self.spec.source,
            event_type=self.spec.event_type or "bench.contact.updated",
            external_id=f"{self.tag}-{contact}",
            version=self.versions[contact],
        ).encode()


class Recorder:
    def __init__(self, good: tuple[int, ...]) -> None:
        self.good = good
        self.latencies: list[float] = []
        self.statuses: Counter[str] = Counter()

    async def send(
        self, client: Client, path: str, request: tuple[bytes, Headers], since: float
    ) -> None:
        try:
            status = await client.post(path, *request)
        except (OSError, asyncio.IncompleteReadError, httpx.HTTPError) as error:
            self.statuses[type(error).__name__] += 1
            return
        self.statuses[str(status)] += 1
        if status in self.good:
            self.latencies.append(time.perf_counter() - since)

    def result(self, elapsed: float) -> Result:
        requests = sum(self.statuses.values())
        ok = len(self.latencies)
        return Result(
            requests=requests,
            ok=ok,
            errors=requests - ok,
            elapsed=elapsed,
            rate=ok / elapsed if elapsed > 0 else 0.0,
            p50_ms=percentile(self.latencies, 0.50) * 1000,
            p99_ms=percentile(self.latencies, 0.99) * 1000,
            max_ms=max(self.latencies, default=0.0) * 1000,
            statuses=dict(self.statuses),
        )


async def _closed(clients: list[Client], spec: Spec, bodies: Bodies, seconds: float) -> Result:
    path, _, good = MODES[spec.mode]
    recorder = Recorder(good)
    start = time.perf_counter()
    end = start + seconds
    sent = 0

    async def loop(client: Client) -> None:
        nonlocal sent
        while time.perf_counter() < end and (not spec.limit or sent < spec.limit):
            sent += 1
            await recorder.send(client, path, bodies.next(), time.perf_counter())

    await asyncio.gather(*(loop(client) for client in clients))
    return recorder.result(time.perf_counter() - start)


async def _open(clients: list[Client], spec: Spec, bodies: Bodies) -> Result:
    path, _, good = MODES[spec.mode]
    recorder = Recorder(good)
    idle: asyncio.Queue[Client] = asyncio.Queue()
    for client in clients:
        idle.put_nowait(client)

    async def one(scheduled: float) -> None:
        client = await idle.get()
        try:
            await recorder.send(client, path, bodies.next(), scheduled)
        finally:
            idle.put_nowait(client)

    total = spec.limit or round(spec.rate * spec.duration)
    tasks = []
    start = time.perf_counter()
    for i in range(total):
        scheduled = start + i / spec.rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    return recorder.result(time.perf_counter() - start)


async def run(spec: Spec) -> Result:
    bodies = Bodies(spec)
    factory = HttpxClient if spec.client == "httpx" else RawClient
    clients: list[Client] = [factory(spec.url) for _ in range(max(1, spec.concurrency))]
    try:
        warmed = 0
        if spec.warmup > 0:
            warm = Spec(**{**asdict(spec), "limit": 0})
            warmed = (await _closed(clients, warm, bodies, spec.warmup)).requests
        cpu_before = _cpu()
        server_before = sum(tree_cpu_seconds(pid) for pid in spec.watch_pids)
        machine_before = machine_busy_seconds()
        if spec.rate > 0:
            result = await _open(clients, spec, bodies)
        else:
            result = await _closed(clients, spec, bodies, spec.duration)
        result.cpu_seconds = _cpu() - cpu_before
        result.warmup_requests = warmed
        result.server_cpu_seconds = (
            sum(tree_cpu_seconds(pid) for pid in spec.watch_pids) - server_before
        )
        result.machine_busy_seconds = machine_busy_seconds() - machine_before
    finally:
        for client in clients:
            await client.close()
    return result


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _command(spec: Spec) -> list[str]:
    return [sys.executable, "-m", "bench.load", json.dumps(asdict(spec))]


def _parse(stdout: str) -> Result:
    return Result(**json.loads(stdout.strip().splitlines()[-1]))


def generate(spec: Spec, timeout: float | None = None) -> Result:
    """Run the load generator in a process of its own; what it measured."""
    return generate_many([spec], timeout)[0]


def generate_many(specs: list[Spec], timeout: float | None = None) -> list[Result]:
    """Several load generators at once, each in its own process."""
    running = [
        subprocess.Popen(_command(spec), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for spec in specs
    ]
    results = []
    for spec, process in zip(specs, running, strict=True):
        limit = timeout or (spec.warmup + spec.duration) * 4 + 60
        try:
            out, err = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        if process.returncode != 0:
            raise RuntimeError(f"load generator failed ({process.returncode}): {err[-2000:]}")
        results.append(_parse(out))
    return results


def main() -> None:
    spec = Spec(**json.loads(sys.argv[1]))
    result = asyncio.run(run(spec))
    print(json.dumps(asdict(result)), flush=True)


if __name__ == "__main__":
    main()
