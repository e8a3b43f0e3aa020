"""What every section shares: the profile, the databases, the Redis, a place for logs, and
timed load runs interleaved between targets so that noise from other work on the machine falls
on all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.config import Profile
from bench.infra import Databases, Processes, RedisServer
from bench.load import Result, Spec, generate
from bench.report import median


@dataclass
class Bench:
    profile: Profile
    dbs: Databases
    redis: RedisServer
    work: Path
    routes_file: Path
    console: Console
    started: float = field(default_factory=time.monotonic)

    def processes(
        self,
        database_url: str,
        label: str,
        extra_env: dict[str, str] | None = None,
        routes_file: Path | None = None,
    ) -> Processes:
        log_dir = self.work / label
        log_dir.mkdir(parents=True, exist_ok=True)
        return Processes(
            database_url,
            self.redis.url,
            log_dir,
            routes_file or self.routes_file,
            extra_env=dict(extra_env or {}),
        )

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.print(f"[dim]{elapsed:6.1f} s[/] {message}")

    def spec(self, url: str, **fields: Any) -> Spec:
        """A timed closed-loop run with this profile's warm-up and duration."""
        spec = Spec(url=url, duration=self.profile.duration, warmup=self.profile.run_warmup)
        return replace(spec, **fields)

    def warm(self, url: str, mode: str = "events", **fields: Any) -> None:
        """The warm-up a server gets before its first timed run (not measured)."""
        spec = Spec(url=url, mode=mode, concurrency=64, duration=self.profile.first_warmup)
        generate(replace(spec, **{"source": "warmup", **fields}))


@dataclass
class Series:
    """The timed runs of one target at one setting."""

    results: list[Result] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        runs = self.results
        return {
            "rate": median([r.rate for r in runs]),
            "p50_ms": median([r.p50_ms for r in runs]),
            "p99_ms": median([r.p99_ms for r in runs]),
            "errors": sum(r.errors for r in runs),
            # Cores used during the timed part: the server (with its children), the load
            # generator, and the whole machine (everything running on it, anyone's).
            "server_cores": median([r.server_cpu_seconds / r.elapsed for r in runs]),
            "client_cores": median([r.cpu_seconds / r.elapsed for r in runs]),
            "machine_busy_cores": median([r.machine_busy_seconds / r.elapsed for r in runs]),
            # The server's CPU time per answered request: steadier than the rate on a machine
            # other work shares, and what the server's own code decides.
            "server_cpu_ms_per_request": median(
                [1000 * r.server_cpu_seconds / r.ok for r in runs if r.ok]
            ),
            "runs": [
                {
                    "rate": r.rate,
                    "p50_ms": r.p50_ms,
                    "p99_ms": r.p99_ms,
                    "requests": r.requests,
                    "errors": r.errors,
                    "statuses": r.statuses,
                    "seconds": r.elapsed,
                }
                for r in runs
            ],
        }


def paired_ratio(numerator: Series, denominator: Series) -> float:
    """The median of the runs' ratios, run i of one target against run i of the other.

    The two runs of a pair ran back to back (interleaved), so a slow drift in what the machine
    gives (other work, its host) falls on both and cancels in their ratio; the ratio of two
    medians taken over the whole series does not cancel it. Measured here: the rates of one
    target varied by up to 25 % between rounds a minute apart.
    """
    ratios = [
        a.rate / b.rate
        for a, b in zip(numerator.results, denominator.results, strict=True)
        if b.rate > 0
    ]
    return median(ratios)


def interleaved(
    targets: dict[str, Callable[[], Spec]],
    runs: int,
    around: Callable[[str], Callable[[Result], None]] | None = None,
) -> dict[str, Series]:
    """`runs` rounds; each round runs every target once, in an order that rotates by round.
    `around(name)`, when given, is called before each run and returns what to call after it."""
    names = list(targets)
    series = {name: Series() for name in names}
    for round_number in range(runs):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            after = around(name) if around is not None else None
            result = generate(targets[name]())
            if after is not None:
                after(result)
            series[name].results.append(result)
    return series
