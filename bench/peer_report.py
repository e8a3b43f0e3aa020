"""The peers section's own table (bench/peers.py): each design's figures beside what it does
not guarantee that the gateway does, in the peers' own documentation's words."""

from __future__ import annotations

from typing import Any

from rich.table import Table

# What each design leaves to its user that the gateway does itself (docs/explanation/
# guarantees.md, "How failures are handled"): a lost answer reconciled before acting again, a
# fenced lease (a late worker's write matches nothing), dead letters, replay, and a key
# remembered after its action (a provider's redelivery a day later is answered, not acted on).
# From each project's documentation.
GUARANTEES: dict[str, str] = {
    "idem": "(the reference: all of these)",
    "naive": (
        "no dedupe at all (every post acts); no lease, no reconcile, no dead letter, no replay "
        "(bench/naive.py: send_task straight from the request)"
    ),
    "procrastinate": (
        "dedupe only while queued: a queueing lock 'allows a single job in todo status' and "
        "'multiple jobs to be in doing status' (how-to, queueing locks), so a repeat after "
        "the job started acts again; a killed worker's jobs stay 'doing' until a periodic task "
        "of the user's retries them (how-to, retry stalled jobs), no fence against the old "
        "worker; no reconcile of a lost answer; dead letters and replay by hand: failed jobs "
        "stay 'failed', retry_failed_job_by_id (how-to, retry a failed job manually)"
    ),
    "pgqueuer": (
        "dedupe only while queued or picked: 'once the job reaches a terminal state ... the "
        "key is released' (reliability model); at-least-once, 'no fencing tokens, no "
        "consumer-side transaction protocol' (ADR-0004), a stalled job 'will run again from "
        "the start' (retry_timer); no reconcile of a lost answer; 'does not include a "
        "built-in dead-letter queue' (reliability model): a failed job is deleted unless "
        "on_failure='hold', then `pgq requeue` (holding failed jobs)"
    ),
}


def peers_table(summary: dict[str, Any]) -> Table:
    table = Table(
        title=f"11 peers, side by side ({summary.get('pool')} x {summary.get('concurrency')})",
        title_justify="left",
    )
    for column in ("action", "design", "events/s", "CPU ms/event", "p50 / p99 ms", "repeat"):
        table.add_column(column, justify="left" if column in ("action", "design") else "right")
    table.add_column("does not guarantee (its docs)", max_width=60)
    for action in ("noop", "100ms"):
        found = summary.get(action)
        if not found:
            continue
        repeats = found.get("repeat_after_action", {})
        for design in GUARANTEES:
            figures = found[design]
            repeat = repeats.get(design)
            table.add_row(
                action,
                design,
                f"{figures['events_per_s']:,.0f}",
                f"{figures['cpu_ms_per_event']['total']:.2f}",
                f"{figures['p50_ms']:.0f} / {figures['p99_ms']:.0f}",
                f"{repeat['actions']} action(s)" if repeat else "",
                GUARANTEES[design] if action == "noop" else "",
            )
    return table
