"""The http action's clients (worker/actions/http.py, `POOLS`): each thread sends through one
client of the process's few, always the same, so its connection is reused and no pool holds
the connections of every request in flight; a forked child builds its own."""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from worker.actions import http


@pytest.fixture(autouse=True)
def fresh_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "_pools", None)


def test_each_thread_keeps_one_client_and_threads_share_a_few() -> None:
    threads = 2 * http.POOLS + 8
    seen: dict[int, list[httpx.Client]] = {}
    all_started = threading.Barrier(threads)

    def look(index: int) -> None:
        first = http.client()
        all_started.wait(timeout=10)  # every thread alive at once: none inherits another's
        seen[index] = [first, http.client()]

    workers = [threading.Thread(target=look, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=10)
    assert len(seen) == threads
    assert all(first is again for first, again in seen.values())
    clients = [first for first, _ in seen.values()]
    distinct = {id(client) for client in clients}
    assert len(distinct) == http.POOLS
    # Handed out in turn: each client serves two or three of the threads.
    shares = sorted(sum(client is other for other in clients) for client in clients)
    assert shares[0] >= 2 and shares[-1] <= 3


def test_a_forked_child_builds_its_own_clients() -> None:
    inherited = http.client()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answers 1 when its client is a new one
        try:
            os.write(writer, b"1" if http.client() is not inherited else b"0")
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    assert said == b"1"
    assert http.client() is inherited
