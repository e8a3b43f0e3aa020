"""A fake CRM for the soak: one effect per write, misbehaving per key as the plan says.

Every POST is answered according to the key's behaviour (`plan.behaviour_of`) and how many
POSTs that key has made. A write that commits counts one effect for the key, whatever the
answer: a second committed write for a key is a duplicated side effect, which the soak
reports. `GET /<collection>/by-key/<key>` is the reconcile lookup: 200 with the id when the
effect exists, else 404. While a collection is down (`take_down`), every write the gateway
sends to it is answered 503 without Retry-After and writes nothing; each is recorded.

Every request is counted per key and per actor: a request carrying `ACTOR_HEADER: workflow`
comes from the soak's workflows (tests/chaos/workflow.py, under `/wf/<collection>`), any other
from the gateway's worker (the routes' URLs). A key has one actor kind; the checker reports a
key that saw the other one.

Writes to the ordered collection (`plan.ORDERED_COLLECTION`) carry a contact and its version
in the body; each committed one is appended to that contact's list, so the checker sees the
order versions were applied in.

Every request is also logged with its arrival time (the wall clock, which PostgreSQL's `now()`
shares on one machine) and the address it came from: the multi-host soak tells its worker hosts
apart by address and checks that no write arrived from a holder whose lease had been taken over
(tests/chaos/net_check.py). That soak also has the CRM hold one request of a host a moment
(`catch_request`) while it cuts the host from PostgreSQL, so the cut finds an attempt
mid-action.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from tests.chaos import plan

# Past the routes' read timeout (1 s): the worker gives up before the answer comes.
SLOW_ANSWER_SECONDS = 2.5
# A write applied late lands this long after it arrived: 0.5-1 s after the client's read
# timeout (1 s) gave up on it, drawn per key.
APPLIED_LATE_SECONDS = (1.5, 2.0)
ACTOR_HEADER = "X-Chaos-Actor"
# A caught request is answered once its host is cut, or after this long whatever happens (a
# bound, not a wait: on a loaded machine the cut's iptables commands take a second or more).
# Held past the routes' 1 s read timeout, the worker sees a timeout instead of the answer: an
# uncertain outcome, which the next holder reconciles.
CATCH_HOLD_SECONDS = 5.0
WORKFLOW = "workflow"
GATEWAY = "gateway"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A worker SIGKILLed mid-request resets its connection: expected here, not news.
        pass


@dataclass(frozen=True)
class Request:
    """One request as it arrived: when (wall clock), from where, what, for which key."""

    at: float
    peer: str
    method: str
    key: str
    actor: str


class FakeCrm:
    def __init__(self, seed: int, host: str = "127.0.0.1", late: bool = True) -> None:
        self.seed = seed
        self.host = host
        # Whether a share of the writes is applied late (`plan.behaviour_of`).
        self.late = late
        # Every request, in arrival order.
        self.requests: list[Request] = []
        # An armed catch: (address, set when a write is held, set to answer it).
        self._catch: tuple[str, threading.Event, threading.Event] | None = None
        self.lock = threading.Lock()
        self.effects: Counter[str] = Counter()
        self.refs: dict[str, str] = {}
        self.posts: Counter[str] = Counter()
        self.lookups: Counter[str] = Counter()
        # key -> actor -> requests (writes and lookups)
        self.actors: dict[str, Counter[str]] = {}
        # What was injected: lost (commit + drop), slow (commit + late answer), 503, 429, 422.
        self.injected: Counter[str] = Counter()
        self.inflight = 0
        # The collection that is down, and the gateway's writes it refused meanwhile.
        self.down: str | None = None
        self.refused_while_down = 0
        # The gateway's writes that reached the CRM, (when, collection), for the outage's bound:
        # a breaker that judges a rate lets through as many failures as it saw successes.
        self.gateway_writes: list[tuple[float, str]] = []
        self.written_before_down = 0
        # The collection that refuses a share of the gateway's writes, how many of the gateway's
        # writes reached it meanwhile, and how many of those it refused.
        self.flaky: str | None = None
        self.flaky_share = 0.0
        self.writes_while_flaky = 0
        self.refused_while_flaky = 0
        self.flaky_rng = random.Random(f"flaky:{seed}")
        # Ordered collection: contact -> (version, key) of each committed write, in order.
        self.applied: dict[str, list[tuple[int, str]]] = {}
        self._server: _Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.server_address[1]}"

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "effects": dict(self.effects),
                "refs": dict(self.refs),
                "posts": dict(self.posts),
                "lookups": dict(self.lookups),
                "actors": {key: dict(by) for key, by in self.actors.items()},
                "injected": dict(self.injected),
                "inflight": self.inflight,
                "refused_while_down": self.refused_while_down,
                "written_before_down": self.written_before_down,
                "writes_while_flaky": self.writes_while_flaky,
                "refused_while_flaky": self.refused_while_flaky,
                "applied": {contact: list(writes) for contact, writes in self.applied.items()},
                "requests": list(self.requests),
            }

    def spell_writes(self) -> dict[str, int]:
        """The gateway's writes that met each spell so far, by the fault that began it (the
        soak ends a spell only once enough writes met it)."""
        with self.lock:
            return {"route_down": self.refused_while_down, "route_flaky": self.writes_while_flaky}

    def take_down(self, collection: str | None, lookback: float = 0.0) -> None:
        """Refuse the gateway's writes to `collection` from now on (None: back up); remember
        how many of its writes came in the `lookback` seconds before."""
        with self.lock:
            self.down = collection
            if collection is not None:
                since = time.monotonic() - lookback
                self.written_before_down = sum(
                    1 for at, name in self.gateway_writes if at >= since and name == collection
                )

    def make_flaky(self, collection: str | None, share: float = 0.0) -> None:
        """Refuse `share` of the gateway's writes to `collection` from now on (None: steady)."""
        with self.lock:
            self.flaky, self.flaky_share = collection, share

    def _refused(self, path: str, actor: str | None) -> bool:
        """Whether this write meets the outage (the workflows' `/wf/...` calls never do)."""
        collection = path.strip("/").split("/", 1)[0]
        with self.lock:
            if actor == WORKFLOW:
                return False
            if collection == self.flaky:
                self.writes_while_flaky += 1
                if self.flaky_rng.random() < self.flaky_share:
                    self.refused_while_flaky += 1
                    self.injected["flaky_503"] += 1
                    return True
            if collection != self.down:
                self.gateway_writes.append((time.monotonic(), collection))
                return False
            self.refused_while_down += 1
            self.injected["outage_503"] += 1
            return True

    def _reply(self, key: str, collection: str) -> tuple[int, dict[str, str], bool, float, bool]:
        """(status, headers, commit, delay, drop) for the next POST of `key`; a write applied
        late (`plan.APPLIED_LATE`) is held `delay` before its commit, and never answered."""
        behaviour = plan.behaviour_at(self.seed, key, collection, self.late)
        with self.lock:
            self.posts[key] += 1
            n = self.posts[key]
        kind = behaviour.kind
        if kind == plan.APPLIED_LATE and n == 1:
            low, high = APPLIED_LATE_SECONDS
            late = low + (high - low) * random.Random(f"{self.seed}:{key}").random()
            return 201, {}, True, late, True
        if kind == plan.LOST and n == 1:
            return 201, {}, True, 0.0, True
        if kind == plan.SLOW and n == 1:
            return 201, {}, True, SLOW_ANSWER_SECONDS, False
        if kind == plan.UNAVAILABLE and n <= behaviour.failures:
            return 503, {"Retry-After": str(behaviour.retry_after)}, False, 0.0, False
        if kind == plan.RATE_LIMITED and n == 1:
            return 429, {}, False, 0.0, False
        if kind == plan.INVALID:
            return 422, {}, False, 0.0, False
        return 201, {}, True, 0.0, False

    def effects_of(self, key: str) -> int:
        """Effects committed for `key` so far (the workflows compare it with what the
        claims API tells them)."""
        with self.lock:
            return self.effects[key]

    def _seen(self, key: str, actor: str | None, peer: str = "", method: str = "") -> None:
        kind = WORKFLOW if actor == WORKFLOW else GATEWAY
        with self.lock:
            self.actors.setdefault(key, Counter())[kind] += 1
            self.requests.append(Request(time.time(), peer, method, key, kind))

    def catch_request(self, peer: str) -> threading.Event:
        """Hold the gateway's next request (a write or a lookup) from `peer`, once, after it
        was handled and before it is answered, until `release_caught()` (or
        CATCH_HOLD_SECONDS); the event returned is set when one is held. Its sender is then
        mid-attempt, holding a lease."""
        caught = threading.Event()
        with self.lock:
            self._catch = (peer, caught, threading.Event())
        return caught

    def release_caught(self) -> None:
        with self.lock:
            catch, self._catch = self._catch, None
        if catch is not None:
            catch[2].set()

    def _hold(self, peer: str, actor: str | None) -> None:
        """Hold this request if a catch is armed for its sender and nothing is held yet."""
        with self.lock:
            catch = self._catch
            if catch is None or catch[0] != peer or actor == WORKFLOW or catch[1].is_set():
                return
            catch[1].set()
        catch[2].wait(CATCH_HOLD_SECONDS)

    def _commit(self, key: str, collection: str, body: bytes) -> str:
        with self.lock:
            self.effects[key] += 1
            ref = self.refs.setdefault(key, f"crm-{len(self.refs) + 1}")
            if collection == plan.ORDERED_COLLECTION:
                contact = json.loads(body)["contact"]
                self.applied.setdefault(contact["id"], []).append((contact["version"], key))
        return ref

    def start(self) -> FakeCrm:
        crm = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # A real CRM drops a request whose body stops coming. Without a bound, a worker's
            # request cut mid-body by an isolated host (its reset lost with the link) held a
            # handler, and the soak's "no request in flight", for good.
            timeout = 30

            def _answer(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                _, _, rest = self.path.partition("/by-key/")
                if not rest:
                    self._answer(404, {}, {})
                    return
                key = unquote(rest)
                crm._seen(key, self.headers.get(ACTOR_HEADER), self.client_address[0], "GET")
                with crm.lock:
                    crm.lookups[key] += 1
                    ref = crm.refs.get(key)
                crm._hold(self.client_address[0], self.headers.get(ACTOR_HEADER))
                if ref is None:
                    self._answer(404, {"error": "not found"}, {})
                else:
                    self._answer(200, {"id": ref}, {})

            def do_POST(self) -> None:
                with crm.lock:
                    crm.inflight += 1
                try:
                    self._post()
                except TimeoutError:
                    # The body (or the answer's send) stalled: close. A body that never came
                    # was not committed; an effect committed before the answer's send stays,
                    # and the worker finds it, as it does after a lost answer.
                    self.close_connection = True
                finally:
                    with crm.lock:
                        crm.inflight -= 1

            def _post(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                key = self.headers.get("idempotency-key", "")
                collection = self.path.strip("/").split("/", 1)[0]
                crm._seen(key, self.headers.get(ACTOR_HEADER), self.client_address[0], "POST")
                if crm._refused(self.path, self.headers.get(ACTOR_HEADER)):
                    with contextlib.suppress(OSError):
                        self._answer(503, {"error": "down"}, {})
                    return
                status, headers, commit, delay, drop = crm._reply(key, collection)
                if commit and delay and drop:  # applied late, never answered
                    with crm.lock:
                        crm.injected["applied_late"] += 1
                    time.sleep(delay)
                    crm._commit(key, collection, body)
                    self.close_connection = True
                    return
                answer: dict[str, Any] = {}
                if commit:
                    answer["id"] = crm._commit(key, collection, body)
                with crm.lock:
                    if drop:
                        crm.injected["lost"] += 1
                    elif delay:
                        crm.injected["slow"] += 1
                    elif status >= 300:
                        crm.injected[str(status)] += 1
                crm._hold(self.client_address[0], self.headers.get(ACTOR_HEADER))
                if delay:
                    time.sleep(delay)
                if drop:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with contextlib.suppress(OSError):
                    self._answer(status, answer, headers)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = _Server((self.host, 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
