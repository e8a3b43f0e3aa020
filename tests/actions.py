"""Python actions the test routes name (`tests.actions:…`); the worker imports them."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import httpx

from worker.actions import ActionContext, ActionResult


def sleep_then_succeed(ctx: ActionContext) -> ActionResult:
    """Work for `payload["seconds"]`, watching the cancel flag; report whether it was set."""
    deadline = time.monotonic() + float(ctx.payload.get("seconds", 0))
    while time.monotonic() < deadline and not ctx.cancelled.is_set():
        time.sleep(0.05)
    return ActionResult(result={"cancelled": ctx.cancelled.is_set()}, external_ref="slow-1")


def _effect(ctx: ActionContext) -> None:
    """Create the side effect at the fake downstream named in the payload (counted per key)."""
    httpx.post(
        ctx.payload["url"], json=ctx.payload, headers={"Idempotency-Key": ctx.key}, timeout=5
    ).raise_for_status()


def effect_then_unstorable(ctx: ActionContext) -> Any:
    """Act, then return what cannot be stored as given: not JSON, or text with NULs."""
    _effect(ctx)
    if ctx.payload.get("kind") == "nul":
        return {"note": "a\x00b", "ratio": float("inf")}
    if ctx.payload.get("kind") == "huge":
        return {"blob": "x" * 200_000}
    return {"when": object()}


def effect_then_exit(ctx: ActionContext) -> None:
    """Act, then kill the worker's process before anything is recorded (an OOM, a segfault)."""
    _effect(ctx)
    os._exit(1)


def effect_then_hang(ctx: ActionContext) -> None:
    """Act, then never return and ignore the cancel flag (a call stuck without a timeout)."""
    _effect(ctx)
    threading.Event().wait()


def echo_payload(ctx: ActionContext) -> ActionResult:
    """Answer with the event's payload as the result (so the result carries its values)."""
    return ActionResult(result=dict(ctx.payload))
