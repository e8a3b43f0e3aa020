"""A fake CRM that creates follow-up tasks and can lose the answer to one: a reusable test double.

It is what `idem demo` talks to, and you may point your own tests or experiments at it the same
way: start it, route an `http` action to `<url>/api/tasks`, set the route's `reconcile_url` to
`<url>/api/tasks/by-key/{key}`, and break it on demand. Only the standard library is used.

    POST /api/tasks               create a task from the JSON payload; 201 with the task
    GET  /api/tasks/by-key/{key}  200 with the task created under that Idempotency-Key, else 404
    GET  /api/tasks               every task, oldest first

Like many real CRMs it does **not** deduplicate: a second POST with the same Idempotency-Key
creates a second task. That is the point of the demo: the gateway, not the CRM, keeps the effect
to one. `lose_next_response()` makes the next create commit its task and then lose the answer,
either by dropping the connection or by answering after the client has given up.

    crm = FakeCrm()
    url = crm.start()
    try:
        ...
        assert len(crm.tasks) == 1
    finally:
        crm.stop()
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import unquote

LoseMode = Literal["drop", "delay"]

TASKS_PATH = "/api/tasks"
BY_KEY_PREFIX = "/api/tasks/by-key/"


class FakeCrm:
    """A threaded HTTP server holding follow-up tasks in memory (see the module docstring).

    `tasks` lists the tasks created, `lookups` the keys asked for on the by-key route, `lost`
    counts the answers lost on purpose. Read them from the test; the server's threads write them
    under `lock`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.tasks: list[dict[str, Any]] = []
        self.lookups: list[str] = []
        self.lost = 0
        self.lock = threading.Lock()
        self._lose: tuple[LoseMode, float] | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def lose_next_response(self, mode: LoseMode = "drop", delay: float = 2.5) -> None:
        """Make the next create commit its task, then lose the answer.

        `drop` closes the connection without a byte of answer (the client sees the connection
        drop); `delay` answers only after `delay` seconds, past a shorter client read timeout.
        """
        with self.lock:
            self._lose = (mode, delay)

    def task_for(self, key: str) -> dict[str, Any] | None:
        """The first task created under `key`, if any."""
        with self.lock:
            return next((t for t in self.tasks if t["idempotency_key"] == key), None)

    def start(self) -> str:
        """Listen on `host:port` (a free port when 0) in a background thread; returns the URL."""
        server = ThreadingHTTPServer((self.host, self.port), _handler(self))
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop listening and close the socket (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _create(self, key: str, payload: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        customer = payload.get("customer") or payload.get("name") or "the customer"
        with self.lock:
            task = {
                "id": f"T-{len(self.tasks) + 1}",
                "assignee": payload.get("assignee"),
                "title": payload.get("title") or f"Follow up with {customer}",
                "idempotency_key": key,
            }
            self.tasks.append(task)
            lose, self._lose = self._lose, None
            if lose is not None:
                self.lost += 1
        return task, lose


def _handler(crm: FakeCrm) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path.startswith(BY_KEY_PREFIX):
                key = unquote(path[len(BY_KEY_PREFIX) :])
                with crm.lock:
                    crm.lookups.append(key)
                task = crm.task_for(key)
                if task is None:
                    self._answer(404, {"error": "not_found"})
                else:
                    self._answer(200, task)
            elif path == TASKS_PATH:
                with crm.lock:
                    tasks = [dict(t) for t in crm.tasks]
                self._answer(200, tasks)
            else:
                self._answer(404, {"error": "not_found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length)
            if self.path.split("?", 1)[0] != TASKS_PATH:
                self._answer(404, {"error": "not_found"})
                return
            try:
                payload = json.loads(raw or b"{}")
            except ValueError:
                payload = None
            if not isinstance(payload, dict):
                self._answer(400, {"error": "the body must be a JSON object"})
                return
            task, lose = crm._create(self.headers.get("idempotency-key", ""), payload)
            if lose is not None:
                mode, delay = lose
                if mode == "drop":
                    # Committed, but the client gets no answer at all.
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                time.sleep(delay)
            with contextlib.suppress(OSError):
                self._answer(201, task)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
