"""Ports for servers started side by side: a port one process was handed is handed to no other
while that process lives, nothing listens on it, and outgoing connections cannot take it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import Iterator

import pytest

from outbox.store import ports


@contextlib.contextmanager
def _held_elsewhere(candidates: list[int]) -> Iterator[int]:
    """Another process that reserves its first port from `candidates` and keeps it for the
    block: the port it was handed."""
    script = textwrap.dedent(
        f"""
        import sys
        from outbox.store import ports
        ports._candidates = lambda: {candidates!r}
        print(ports.free_port(), flush=True)
        sys.stdin.read()
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as other:
        assert other.stdout is not None and other.stdin is not None
        try:
            yield int(other.stdout.readline())
        finally:
            other.stdin.close()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[deque[int]]:
    """The reservations the test makes, apart from the process's own; given up after it."""
    mine: deque[int] = deque()
    monkeypatch.setattr(ports, "_held", mine)
    yield mine
    while mine:
        os.close(mine.pop())


@pytest.fixture
def two_ports(held: deque[int]) -> list[int]:
    """Two ports of the module's own range, found free and then given up again: the test
    reserves them itself."""
    handed = [ports.free_port(), ports.free_port()]
    while held:
        os.close(held.pop())
    return handed


def test_a_port_another_process_holds_is_not_handed_out_until_that_process_ends(
    monkeypatch: pytest.MonkeyPatch, two_ports: list[int]
) -> None:
    first, second = two_ports
    with _held_elsewhere([first]) as theirs:
        assert theirs == first
        monkeypatch.setattr(ports, "_candidates", lambda: [first, second])
        assert ports.free_port() == second
    monkeypatch.setattr(ports, "_candidates", lambda: [first])
    assert ports.free_port() == first


def test_a_port_something_listens_on_is_passed_over(
    monkeypatch: pytest.MonkeyPatch, two_ports: list[int]
) -> None:
    first, second = two_ports
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", first))
        listener.listen()
        monkeypatch.setattr(ports, "_candidates", lambda: [first, second])
        assert ports.free_port() == second


def test_ports_come_from_outside_the_ephemeral_range(held: deque[int]) -> None:
    low, high = ports._ephemeral_range()
    handed = [ports.free_port() for _ in range(20)]
    assert len(set(handed)) == 20
    assert all(ports.LOWEST_PORT <= port < 65536 and not low <= port <= high for port in handed)


def test_a_process_keeps_a_bounded_number_of_reservations(
    monkeypatch: pytest.MonkeyPatch, held: deque[int]
) -> None:
    monkeypatch.setattr(ports, "HELD_LOCKS", 3)
    handed = [ports.free_port() for _ in range(5)]
    assert len(held) == 3
    # The two oldest were given up: another process may now be handed them.
    with _held_elsewhere(handed[:1]) as theirs:
        assert theirs == handed[0]
