"""What the benchmark's bare ASGI servers share (the naive endpoint, the fake downstream)."""

from __future__ import annotations

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
