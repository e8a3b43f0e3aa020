"""1. Ingest: the receiver beside the ceiling (bare uvicorn + the same INSERTs).
2. Duplicates: the receiver answering repeats of known keys.

One database; the receiver (`idem serve`, noop routes), the ceiling and a bare uvicorn (no
database: what the HTTP server alone answers) run side by side, each idle while another is
measured. The known keys are created first (through the receiver, then marked succeeded, so a
repeat gets the stored result); then, at each concurrency, timed runs rotate between new events
on the receiver, the ceiling, repeats on the receiver, and the bare server, so noise from other
work on the machine falls on all of them alike.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from bench.context import Bench, interleaved, paired_ratio
from bench.infra import sql
from bench.load import Spec, generate
from bench.report import Check

INGEST_TARGET = 0.80


def create_known_keys(bench: Bench, receiver: str, url: str, known: int) -> None:
    created = generate(
        Spec(
            url=receiver,
            concurrency=16,
            duration=600,
            limit=known,
            source="dup",
            sequential_ids=True,
        )
    )
    if created.ok != known:
        raise RuntimeError(f"duplicates: created {created.ok} of {known} keys: {created.statuses}")
    sql(
        url,
        "UPDATE idempotency_keys SET status = 'succeeded', result = '{\"status\": 201}'"
        " WHERE source = 'dup'",
    )
    sql(url, "VACUUM ANALYZE idempotency_keys")


def run(bench: Bench) -> tuple[dict[str, Any], dict[str, Any], list[Check]]:
    profile = bench.profile
    url = bench.dbs.create("ingest")
    procs = bench.processes(url, "ingest")
    checks: list[Check] = []
    known = profile.known_keys
    try:
        urls = {
            "receiver": procs.start_receiver(),
            "ceiling": procs.start_ceiling(),
            "bare": procs.start_ceiling("bare", bare=True),
        }
        procs.ready()
        pids = {name: procs.pid(name) for name in urls}
        bench.say(f"ingest: {known} known keys for the duplicates")
        create_known_keys(bench, urls["receiver"], url, known)
        for target in urls.values():
            bench.warm(target)
        bench.warm(urls["receiver"], mode="duplicates", source="dup", known=known)
        bench.dbs.analyze(url)

        def spec(name: str, concurrency: int) -> Spec:
            if name == "duplicates":
                return bench.spec(
                    urls["receiver"],
                    mode="duplicates",
                    source="dup",
                    known=known,
                    concurrency=concurrency,
                    watch_pids=[pids["receiver"]],
                )
            return bench.spec(urls[name], concurrency=concurrency, watch_pids=[pids[name]])

        ingest: dict[str, Any] = {}
        duplicates: dict[str, Any] = {"known_keys": known}
        for concurrency in profile.concurrencies:
            bench.say(f"ingest: receiver, ceiling, duplicates, bare at {concurrency} connections")
            names = ["receiver", "ceiling", "duplicates"]
            if concurrency == max(profile.concurrencies):
                names.append("bare")
            series = interleaved(
                {name: partial(spec, name, concurrency) for name in names}, profile.runs
            )
            summary: dict[str, Any] = {name: s.summary() for name, s in series.items()}
            dup = summary.pop("duplicates")
            share = paired_ratio(series["receiver"], series["ceiling"])
            summary["receiver_share_of_ceiling"] = share
            dup["share_of_ingest"] = paired_ratio(series["duplicates"], series["receiver"])
            ingest[f"c{concurrency}"] = summary
            ingest_rate = summary["receiver"]["rate"]
            dup["ingest_rate"] = ingest_rate
            duplicates[f"c{concurrency}"] = dup
            procs.check_alive()
            receiver = summary["receiver"]
            checks.append(
                Check(
                    "1 ingest",
                    f"accepted/s, {concurrency} clients "
                    f"(p50 {receiver['p50_ms']:.0f} / p99 {receiver['p99_ms']:.0f} ms)",
                    receiver["rate"],
                    "/s",
                    "ceiling",
                    summary["ceiling"]["rate"],
                    f">= {INGEST_TARGET:.0%} of ceiling (got {share:.0%})"
                    + errors_note(receiver, summary["ceiling"]),
                    share >= INGEST_TARGET and not receiver["errors"],
                )
            )
            checks.append(
                Check(
                    "2 duplicates",
                    f"answers/s, {concurrency} clients "
                    f"(p50 {dup['p50_ms']:.0f} / p99 {dup['p99_ms']:.0f} ms)",
                    dup["rate"],
                    "/s",
                    "ingest",
                    ingest_rate,
                    f">= ingest rate (got {dup['share_of_ingest']:.0%})" + errors_note(dup),
                    dup["share_of_ingest"] >= 1 and not dup["errors"],
                )
            )
        counted = sql(url, "SELECT sum(duplicate_count) FROM idempotency_keys WHERE source='dup'")
        duplicates["duplicate_count_in_db"] = int(counted[0][0] or 0)
        procs.check_alive()
    finally:
        procs.stop_all()
        bench.dbs.drop(url)
    return ingest, duplicates, checks


def errors_note(*summaries: dict[str, Any]) -> str:
    """A note when some answers were not the expected ones (they do not count in the rate)."""
    errors = sum(int(s["errors"]) for s in summaries)
    return f"; {errors} unexpected answers" if errors else ""
