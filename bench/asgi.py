"""What the benchmark's bare ASGI servers share (the naive endpoint, the fake downstream)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown; return at shutdown."""
    while True:
        message = await receive()
        kind = message["type"].rsplit(".", 1)[-1]
        await send({"type": f"lifespan.{kind}.complete"})
        if kind == "shutdown":
            return


async def read_body(receive: Receive) -> bytes:
    """The request's whole body."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def posted(scope: Scope, receive: Receive, send: Send) -> Any:
    """The request's JSON document; None for the lifespan scope, answered here until shutdown."""
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return None
    return json.loads(await read_body(receive))


async def answer(send: Send, status: int, body: bytes) -> None:
    """A JSON answer."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def serve(factory: str, port: int) -> None:
    """One uvicorn process serving `factory` ("module:function") with the receiver's server
    options that matter here: one worker, no access log, no server header."""
    import uvicorn

    uvicorn.run(
        factory,
        factory=True,
        host="127.0.0.1",
        port=port,
        workers=1,
        log_config=None,
        access_log=False,
        server_header=False,
    )
