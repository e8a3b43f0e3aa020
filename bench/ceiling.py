"""The ingest ceiling: the same ASGI server as the receiver (uvicorn, one process, same options)
with a bare handler that does only the receiver's INSERTs (RESERVE_KEY) in one transaction,
through the same engine factory. `python -m bench.ceiling --port P` (DATABASE_URL from the
environment).

No FastAPI, no envelope validation, no key derivation beyond one hash, no logging, no metrics:
what remains is HTTP parsing, one JSON decode and the database round trip. `--bare` leaves the
database out too: what uvicorn alone answers on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.core.connections import server_options
from outbox.core.settings import get_settings
from outbox.core.wire import PROCESS_TASK
from outbox.store.engines import create_receiver_engine
from outbox.store.ingest import RESERVE_KEY

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ACCEPTED = [(b"content-type", b"application/json")]


class Ceiling:
    def __init__(self, *, database: bool = True) -> None:
        self.engine: AsyncEngine | None = None
        # Without the database: what uvicorn alone answers on this machine (a reference).
        self.database = database

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        document = json.loads(b"".join(chunks))
        external_id = str(document["external_id"])
        digest = hashlib.sha256(external_id.encode()).hexdigest()
        params = {
            "key": f"ceiling:{digest}",
            "payload_hash": digest,
            "correlation_id": digest[:32],
            "source": document["source"],
            "event_type": document["event_type"],
            "external_id": external_id,
            "version": None,
            "payload": json.dumps(document["payload"]),
            "route": "default",
            "ttl_seconds": 30 * 86_400.0,
            "workflow_name": None,
            "execution_id": None,
            "task_name": PROCESS_TASK,
            # RESERVE_KEY's other parameters, as the receiver gives them for a plain event.
            "lane": None,
            "lane_rank": None,
            "trace_context": None,
        }
        status = 202
        if self.database:
            assert self.engine is not None
            async with self.engine.begin() as conn:
                row = (await conn.execute(RESERVE_KEY, params)).first()
            status = 202 if row is not None else 200
        body = b'{"key":"%s","status":"pending"}' % params["key"].encode()
        await send({"type": "http.response.start", "status": status, "headers": ACCEPTED})
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.engine = create_receiver_engine(get_settings())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.engine is not None:
                    await self.engine.dispose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app() -> Ceiling:
    return Ceiling()


def create_bare_app() -> Ceiling:
    return Ceiling(database=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bare", action="store_true", help="answer without the database")
    args = parser.parse_args()
    # The options `idem serve` gives uvicorn.
    uvicorn.run(
        "bench.ceiling:create_bare_app" if args.bare else "bench.ceiling:create_app",
        factory=True,
        host="127.0.0.1",
        port=args.port,
        workers=1,
        log_config=None,
        access_log=False,
        server_header=False,
        **server_options(get_settings()),
    )


if __name__ == "__main__":
    main()
