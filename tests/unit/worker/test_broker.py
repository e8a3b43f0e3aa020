"""The worker's patch to kombu's Redis channel (worker/broker.py), without a server: which
channels it refuses, and that installing it twice wraps kombu's method once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

from worker import broker


def test_installing_twice_wraps_kombus_method_once() -> None:
    """`create_worker_app` may run more than once in a process; the patch stays one layer."""
    broker.install()
    patched = kombu_redis.Channel.__dict__["_connparams"]
    broker.install()
    assert kombu_redis.Channel.__dict__["_connparams"] is patched


@pytest.mark.parametrize(
    "transport",
    [None, SimpleNamespace(client=None, default_port=6379)],
    ids=["closed channel", "transport closed under it"],
)
def test_a_channel_without_its_connection_raises_a_connection_error(transport: object) -> None:
    """Where kombu would read `hostname` or `client` from None (an AttributeError that stops
    the worker), the patched channel raises a redis ConnectionError, which Celery recovers
    from."""
    broker.install()
    channel = SimpleNamespace(connection=transport)
    with pytest.raises(broker.ChannelWithoutConnection) as refused:
        kombu_redis.Channel._connparams(channel)
    assert isinstance(refused.value, RedisConnectionError)
    assert isinstance(refused.value, kombu_redis.Transport.connection_errors)
