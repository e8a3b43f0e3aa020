"""What a process loads to start: the worker, the relay, the sweeper and the terminal commands
serve no HTTP API and run no async engine, so they load neither the web framework nor
SQLAlchemy's asyncio layer (with the ORM it pulls in). Together they added 0.1 to 0.15 s of CPU
to every start of a worker."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

RECEIVER_ONLY = ("fastapi", "starlette", "sqlalchemy.ext.asyncio", "sqlalchemy.orm")


def loaded_after(module: str) -> list[str]:
    names = f"m for m in {RECEIVER_ONLY!r} if m in sys.modules"
    code = f"import sys, {module}; print(' '.join({names}))"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return run.stdout.split()


def test_the_worker_and_the_commands_load_no_web_framework_and_no_async_engine() -> None:
    assert loaded_after("worker.app") == []
    assert loaded_after("outbox.cli") == []


def test_the_receiver_loads_them() -> None:
    # The check above sees what it looks for: the receiver's app loads all four.
    assert loaded_after("outbox.app") == list(RECEIVER_ONLY)
