"""One Redis client per kombu channel, not one per acknowledgement.

kombu's Redis channel builds a new `redis.Redis` object every time it needs a synchronous
client (`Channel.conn_or_acquire`): when a message arrives (recording it as unacknowledged),
when it is acknowledged, when unacknowledged messages are restored. The client object holds no
connection of its own (the channel's connection pool does), but building one costs redis-py 8
its whole table of response callbacks, and in the worker's profile under load that building
was a sixth of the time the process held the interpreter (py-spy `--gil`;
docs/explanation/performance.md, "What keeps the worker's HTTP cheap").

`install()` makes the channel keep the client it built and hand it out again while the
channel's connection pool is the one it was built on. A `redis.Redis` over a pool is shared
by threads as a matter of course (each command takes a connection from the pool and gives it
back), so the acknowledgements, which Celery sends from its pool threads, use it as they used
their own. Nothing else changes: the commands, the pool and its connections are the same, and
a channel whose pool is dropped (`Channel._disconnect_pools`, when the connection to Redis is
lost) builds its next client as before, through the channel's own `_create_client`, so a
channel left without its connection still fails as `worker.broker` makes it fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.broker import patch_channel

# The attribute of a channel that holds its kept client.
_KEPT = "_idem_client"


def install() -> None:
    """Patch `kombu.transport.redis.Channel._create_client` in this process (once)."""
    patch_channel("_create_client", _keeping, "worker/redis_client.py no longer applies")


def _keeping(original: Callable[..., Any]) -> Callable[..., Any]:
    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:
            # Built once per channel by kombu itself (`Channel.client`, a cached property).
            return original(self, asynchronous=True)
        kept = self.__dict__.get(_KEPT)
        # `_pool` is None before the first client and after the pool was dropped.
        if kept is not None and self._pool is not None and kept.connection_pool is self._pool:
            return kept
        built = original(self, asynchronous=False)
        setattr(self, _KEPT, built)
        return built

    return _create_client
