"""Liveness of the processes that serve no HTTP: the relay and the sweeper touch a heartbeat
file on every turn of their loop, and `idem alive` (their container healthcheck) reads it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.support import ROOT, Stack, run_idem, wait_until


def _alive(path: Path, max_age: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HEARTBEAT_FILE": str(path), "PYTHONPATH": str(ROOT)}
    return run_idem("alive", "--max-age", str(max_age), env=env, timeout=60)


def test_relay_and_sweeper_are_alive_while_their_loops_turn(
    private_stack: Stack, tmp_path: Path
) -> None:
    """`idem alive` fails before the process starts, succeeds while its loop turns, and fails
    again once the loop stops turning (the process frozen with SIGSTOP, as a hung loop)."""
    for name, start in (
        ("relay", private_stack.start_relay),
        ("sweeper", private_stack.start_sweeper),
    ):
        beat = tmp_path / f"{name}.alive"
        assert _alive(beat).returncode == 1
        private_stack.extra_env["HEARTBEAT_FILE"] = str(beat)
        start()
        wait_until(lambda: _alive(beat).returncode == 0, timeout=60)  # noqa: B023
        process = private_stack.processes[name]
        process.send_signal(signal.SIGSTOP)
        try:
            stale = wait_until(
                lambda: (run := _alive(beat, max_age=2)).returncode == 1 and run,  # noqa: B023
                timeout=60,
            )
        finally:
            process.send_signal(signal.SIGCONT)
        assert "s old" in stale.stderr
