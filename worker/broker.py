"""The worker's patch to kombu's Redis transport for a lost connection: a channel that lost its
connection fails like a lost connection, so a Redis restart no longer stops the worker.
(`patch_channel` applies it, and `worker.redis_client`'s, which keeps one client per channel.)

What goes wrong, seen with kombu 5.7.0 and Celery 5.7.0 (the newest releases; kombu 5.3 to
5.7 share the three pieces named below, and kombu issues 582 and 970 report the same error
from other paths). When Redis goes away under a worker with tasks in flight, Celery's
consumer cleans up in two steps (`Consumer.on_connection_error_after_connected`):

1. `Connection.collect()` closes the default channel (the one the tasks came on) and then
   every channel of the transport. The default channel's close first reads its pending BRPOP,
   which raises a connection error; the transport then closes its other channels, and the
   first one whose close needs Redis (the remote-control channel unsubscribes) raises again,
   which ends `Transport.close_connection` early. The task channel is left open, still holding
   the unacknowledged messages, and the connection drops the transport's settings
   (`transport.client = None`).
2. `Connection.close()` closes the default channel again. This time the close gets as far as
   restoring the unacknowledged messages, which asks the channel for a new Redis client, and
   `Channel._connparams` reads `self.connection.client.hostname` from the dropped settings:
   `AttributeError: 'NoneType' object has no attribute 'hostname'`. Celery's `ignore_errors`
   around the close swallows connection and channel errors only, so the AttributeError
   reaches the worker's blueprint: "Unrecoverable error", and the worker stops (`python -m
   worker` then exits 70). A task that finishes after the connection was lost has the same
   fate when its acknowledgement reaches its old, closed channel (`channel.connection` is None
   there).

The patch: `Channel._connparams` of a channel that no longer has its connection (closed, or
left behind by a transport that was closed) raises `ChannelWithoutConnection`, a
`redis.exceptions.ConnectionError`. Celery and kombu treat that as the broker being away: the
consumer reconnects and goes on consuming, and an acknowledgement that cannot be sent is
logged ("Couldn't ack") and dropped.

Nothing is lost by that. The restore it skips runs milliseconds after the loss, when Redis is
nearly always still away, so it would have failed as well; the messages it would have pushed
back are still in Redis's `unacked` hash if Redis kept its data, and any worker's periodic
restore hands them out again after `visibility_timeout`; if Redis lost its data, the sweeper
re-drives their keys from the database. A message whose acknowledgement was dropped comes
back the same way, and the claim refuses it, since its key is already finished. Tasks in
flight are not stopped: they run to their end and record their outcomes in the database under
their fence.

`install()` applies the patch to kombu's Redis channel classes (the Sentinel channel
inherits it) in this process; `create_worker_app` calls it. Remove this module when a kombu
release closes every channel before dropping a transport's settings, or fails such a channel
with a connection error itself: the kombu test in
tests/integration/worker/test_broker_restart.py, run without `install()`, tells.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kombu
from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError


class ChannelWithoutConnection(RedisConnectionError):
    """A kombu Redis channel was asked for a new Redis client after losing its connection."""


def install() -> None:
    """Patch `kombu.transport.redis.Channel._connparams` in this process (once)."""
    patch_channel(
        "_connparams",
        _failing_without_connection,
        "worker/broker.py no longer applies; check whether a Redis restart still stops the worker",
    )


# Set on a method this module's patches built, so a second install leaves it as it is.
_PATCHED = "_idem_patched"


def patch_channel(
    name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], missing: str
) -> None:
    """Replace kombu's Redis `Channel.<name>` by `wrap(original)` in this process, once;
    `missing` says what it means when this kombu has no such method."""
    channel = kombu_redis.Channel
    original = channel.__dict__.get(name)
    if original is None:
        raise RuntimeError(f"kombu {kombu.__version__} has no Channel.{name}: {missing}")
    if getattr(original, _PATCHED, False):
        return
    patched = wrap(original)
    setattr(patched, _PATCHED, True)
    # Patching kombu's class in place is the point: every channel of this process is one.
    setattr(channel, name, patched)


def _failing_without_connection(original: Callable[..., Any]) -> Callable[..., Any]:
    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        transport = self.connection
        if transport is None or transport.client is None:
            raise ChannelWithoutConnection(
                "this broker channel lost its connection (Redis went away); its unacknowledged"
                " messages come back after visibility_timeout"
            )
        return original(self, asynchronous=asynchronous)

    return _connparams
