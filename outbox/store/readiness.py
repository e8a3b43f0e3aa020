"""Is this receiver ready to take traffic: database reachable, schema at head, broker reachable.

Each check is bounded (the engine's timeouts, two seconds for Redis) and logs why it failed, so
a probe every few seconds costs little and says what is wrong.
"""

from __future__ import annotations

import redis
from sqlalchemy import Engine

from outbox.core.logs import get_logger
from outbox.store.migrate import is_at_head

log = get_logger(__name__)


def readiness(engine: Engine, redis_url: str) -> dict[str, bool]:
    """Each dependency's state: reachable database, schema at head, reachable broker."""
    checks = {"database": False, "migrations": False, "broker": False}
    try:
        with engine.connect() as conn:
            checks["database"] = True
            checks["migrations"] = is_at_head(conn)
    except Exception as error:
        log.warning("readyz.database", error=type(error).__name__)
    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=2)
        with client:
            checks["broker"] = bool(client.ping())
    except Exception as error:
        log.warning("readyz.broker", error=type(error).__name__)
    return checks
