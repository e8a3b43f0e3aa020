"""`idem purge`: forget expired keys and old published outbox rows, from the terminal.

The sweeper purges on its own schedule (`outbox.maintenance.sweeper`); this command runs the
same purge (`outbox.maintenance.purge`) once, with a dry run first. Same conventions as every
command (`outbox.terminal`): a table or `--json`; exit 0 done, 2 refused.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from functools import partial
from typing import Annotated

import typer

from outbox import terminal
from outbox.core.logs import get_logger
from outbox.terminal import AsJson

log = get_logger("idem.operator")

PURGE_REFUSAL = "purge deletes data: run `idem purge --dry-run` first, then `idem purge --yes`"


def purge_command(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go.")] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Delete it, in batches.")] = False,
    batch: Annotated[int, typer.Option(min=1, max=100_000, help="Rows per statement.")] = 1000,
    as_json: AsJson = False,
) -> None:
    """Forget expired keys and old published outbox rows (needs --dry-run or --yes)."""
    from outbox.maintenance.pace import BatchPace
    from outbox.maintenance.purge import purge

    if dry_run == yes:
        terminal.fail("choose --dry-run or --yes, not both" if yes else PURGE_REFUSAL)
    with (
        terminal.engine() as (settings, engine),
        terminal.progress(disable=as_json or dry_run) as progress,
    ):
        retention = settings.outbox_retention_seconds
        pace = BatchPace(batch)
        run = partial(purge, engine, retention_seconds=retention, batch=batch, pace=pace)
        report = run(dry_run=True)
        if yes:
            # A batch per transaction (purge's own loop, one turn at a time) to move the bar;
            # the outbox's days are kept by the first turn, and each turn's batch follows the
            # last one's time (`pace`).
            total = report.expired_keys + report.published_outbox_rows
            task, keys, rows = progress.add_task("purging", total=total), 0, 0
            first = step = run(dry_run=False, max_batches=1)
            while True:
                keys, rows = keys + step.expired_keys, rows + step.published_outbox_rows
                progress.advance(task, step.expired_keys + step.published_outbox_rows)
                if not step.full:
                    break
                step = run(dry_run=False, max_batches=1, days=False)
            report = replace(first, expired_keys=keys, published_outbox_rows=rows)
            log.info(
                "purge.finished",
                expired_keys=keys,
                published_outbox_rows=rows,
                outbox_days_dropped=len(report.outbox_days_dropped),
            )
    if as_json:
        return terminal.print_json({**asdict(report), "outbox_retention_seconds": retention})
    days = ", ".join(report.outbox_days_dropped) or "none"
    terminal.console().print(
        f"{'would remove' if report.dry_run else 'removed'} {report.expired_keys} expired keys"
        " (with their events, outbox rows and resolved dead letters) and"
        f" {report.published_outbox_rows} outbox rows published more than {retention:g} s ago;"
        f" outbox days {'to drop' if report.dry_run else 'dropped'}: {days}"
    )
    if report.outbox_days_waiting:
        terminal.console().print(
            "outbox days ended but still holding a row not yet published or within the"
            f" retention: {', '.join(report.outbox_days_waiting)}"
        )
