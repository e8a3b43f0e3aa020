"""The receiver's bound on a database step holds however slowly the step stops."""

from __future__ import annotations

import asyncio

import pytest

from outbox.app import bounded_wait


def test_answers_at_the_bound_while_a_cancelled_step_still_winds_down() -> None:
    """A step that takes its time to stop once cancelled (psycopg asking a partitioned server
    to cancel its query) does not hold the caller: TimeoutError comes while the step is still
    winding down, and the step is cancelled and ends on its own afterwards."""

    async def scenario() -> None:
        release = asyncio.Event()
        stages: list[str] = []

        async def slow_to_stop() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                stages.append("cancelled")
                await release.wait()  # the driver's own cancel request and wait
                stages.append("wound down")
                raise

        step = asyncio.ensure_future(slow_to_stop())
        # Only a guard: a bound that waited for the step would otherwise wait forever.
        asyncio.get_running_loop().call_later(10, release.set)
        with pytest.raises(TimeoutError):
            await bounded_wait(step, 0.05)
        await asyncio.sleep(0)
        assert stages == ["cancelled"]
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert stages == ["cancelled", "wound down"]

    asyncio.run(scenario())


def test_passes_on_the_result_and_the_error_of_a_step_within_the_bound() -> None:
    """Within the bound a step's result is returned and its error raised, as awaited
    directly."""

    async def value() -> int:
        return 7

    async def failing() -> None:
        raise ConnectionError("the database went away")

    async def scenario() -> None:
        assert await bounded_wait(value(), 5) == 7
        with pytest.raises(ConnectionError, match="went away"):
            await bounded_wait(failing(), 5)

    asyncio.run(scenario())


def test_a_cancelled_caller_cancels_its_step() -> None:
    """A request cancelled for another reason takes its step with it, rather than leaving it
    running."""

    async def scenario() -> None:
        started = asyncio.Event()

        async def forever() -> None:
            started.set()
            await asyncio.sleep(3600)

        step = asyncio.ensure_future(forever())
        caller = asyncio.ensure_future(bounded_wait(step, 3600))
        await started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        with pytest.raises(asyncio.CancelledError):
            await step

    asyncio.run(scenario())
