"""When to try again: a pure function of the attempt, with jitter from an injected source.

Exponential backoff with full jitter (the delay is uniform in [0, min(cap, base * 2^(n-1))])
spreads retries of many keys that failed together, so a recovering downstream is not hit by a
synchronized wave. A server's Retry-After is a floor: we never come back sooner than asked.
"""

from __future__ import annotations

import random


def next_delay(
    attempt: int,
    retry_after: float | None,
    *,
    base: float,
    cap: float,
    rng: random.Random,
) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based)."""
    # The exponent is bounded so a huge attempt number cannot overflow a float.
    ceiling = min(cap, base * 2 ** min(max(0, attempt - 1), 64))
    delay = rng.uniform(0, ceiling)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay
