"""How big and how long each measurement is: the full run, and --smoke (seconds, not minutes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    # Timed load runs: a warm-up per server first, then `runs` runs of `duration` seconds,
    # each after a short warm-up of its own on fresh connections; figures are medians.
    first_warmup: float
    run_warmup: float
    duration: float
    runs: int
    concurrencies: tuple[int, ...]
    # Duplicates: keys created first, then repeated at random.
    known_keys: int
    # End to end: closed-loop bursts for the maximum, open-loop runs at half of it.
    e2e_burst_seconds: float
    e2e_latency_seconds: float
    e2e_runs: int
    # Relay: outbox rows pre-filled for the drain alone, and for each ingest-while-draining run.
    relay_backlog: int
    relay_concurrent_backlog: int
    # Growth: existing keys in the small and the large database.
    growth_small: int
    growth_large: int
    # Memory: events per checkpoint (three checkpoints), at most `memory_step`; with a budget,
    # as many as the end-to-end rate measured before lets through in that many seconds.
    memory_step: int
    memory_budget_seconds: float
    # Provider webhooks: distinct signed events per run.
    webhook_events: int
    # Slow downstreams: each run offers what the bound (attempts in flight / the downstream's
    # delay) carries in `slow_seconds`, at least `slow_min_events`; `slow_runs` rounds.
    slow_seconds: float
    slow_min_events: int
    slow_runs: int
    # Peers: events per closed-loop run with a noop action and with a 100 ms downstream, and
    # rounds (every design once a round, the order rotating).
    peers_events: int = 1500
    peers_slow_events: int = 1000
    peers_runs: int = 3
    # The downstream's answer times measured (seconds).
    slow_delays: tuple[float, ...] = (0.1, 1.0)
    # Fan-out: the downstreams' answer times (0: a noop action); the noop one runs `e2e_runs`
    # rounds, a slow one `slow_runs`.
    fanout_delays: tuple[float, ...] = (0.0, 0.1)


FULL = Profile(
    name="full",
    first_warmup=3.0,
    run_warmup=0.5,
    duration=4.0,
    runs=5,
    concurrencies=(16, 64),
    known_keys=1000,
    e2e_burst_seconds=5.0,
    e2e_latency_seconds=6.0,
    e2e_runs=5,
    relay_backlog=100_000,
    relay_concurrent_backlog=100_000,
    growth_small=10_000,
    growth_large=1_000_000,
    memory_step=50_000,
    memory_budget_seconds=270.0,
    webhook_events=1000,
    slow_seconds=15.0,
    slow_min_events=40,
    slow_runs=3,
)

SMOKE = Profile(
    name="smoke",
    first_warmup=0.5,
    run_warmup=0.2,
    duration=0.6,
    runs=1,
    # One setting: the smoke checks that every step runs and writes numbers; a second
    # concurrency would run the same code again (15 s of `make test`).
    concurrencies=(64,),
    known_keys=100,
    e2e_burst_seconds=1.0,
    e2e_latency_seconds=1.0,
    e2e_runs=1,
    relay_backlog=2_000,
    relay_concurrent_backlog=2_000,
    growth_small=1_000,
    growth_large=5_000,
    memory_step=100,
    memory_budget_seconds=0.0,
    webhook_events=100,
    slow_seconds=0.25,
    slow_min_events=8,
    slow_runs=1,
    peers_events=40,
    peers_slow_events=30,
    peers_runs=1,
    slow_delays=(0.1,),
    fanout_delays=(0.0,),
)
