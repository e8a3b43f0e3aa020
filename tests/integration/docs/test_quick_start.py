"""The commands the README and the first tutorial show, run as they are written: the `make`
targets exist, the `idem` commands answer, and the `curl` of an event, sent twice to a real
stack, is accepted once, answered as a duplicate the second time, and acts exactly once."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT, Downstream, Stack, wait_until

PAGES = [ROOT / "README.md", ROOT / "docs/tutorials/first-event.md"]


def _shell_blocks(page: Path) -> list[str]:
    """The page's ```sh blocks, continuation lines joined."""
    blocks = re.findall(r"```sh\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    return [block.replace("\\\n", " ") for block in blocks]


def _commands(page: Path, program: str) -> list[str]:
    """Every command of the page's shell blocks that starts with `program`, without its
    comment; a command may run over several lines (a quoted body)."""
    found = []
    for block in _shell_blocks(page):
        for command in re.split(r"\n(?=\S)", block.strip()):
            if command.startswith(program):
                found.append(re.sub(r"\s+#[^'\n]*$", "", command, flags=re.MULTILINE).strip())
    return found


def _curl(command: str, stack: Stack) -> tuple[int, dict[str, str], dict[str, object]]:
    """Run a page's curl against the stack: status, headers, JSON body."""
    command = command.replace("localhost:8000", stack.url.removeprefix("http://"))
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    head, _, body = run.stdout.replace("\r\n", "\n").partition("\n\n")
    status = int(head.split()[1])
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, _, value in (line.partition(":") for line in head.splitlines()[1:])
    )
    return status, headers, json.loads(body)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_make_targets_shown_exist(page: Path) -> None:
    """`make run` and `make test` (and any other target a page shows) are Makefile targets."""
    targets = set(re.findall(r"^([a-z0-9-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    shown = {command.split()[1] for command in _commands(page, "make ")}
    assert {"run", "test"} <= shown
    assert shown <= targets


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_event_shown_is_accepted_once_and_acted_on_once(
    page: Path, stack: Stack, downstream: Downstream
) -> None:
    """The page's curl, sent twice: 202 with `"duplicate": false`, then 200 with
    `"duplicate": true` and `Idempotent-Replayed: true`; the fake CRM sees one task."""
    curls = _commands(page, "curl ")
    assert len(curls) == 1, curls
    status, _, first = _curl(curls[0], stack)
    assert (status, first["duplicate"], first["status"]) == (202, False, "pending")
    key = str(first["key"])
    wait_until(lambda: downstream.effects[key] == 1)
    status, headers, again = _curl(curls[0], stack)
    assert (status, again["duplicate"], again["key"]) == (200, True, key)
    assert headers["idempotent-replayed"] == "true"
    assert again["correlation_id"] == first["correlation_id"]
    assert downstream.effects[key] == 1


def test_the_tutorials_idem_commands_answer(stack: Stack) -> None:
    """`idem stats` and `idem dlq list`, as the tutorial shows them, exit 0 on a running
    gateway."""
    commands = _commands(ROOT / "docs/tutorials/first-event.md", ".venv/bin/idem ")
    assert {"stats", "dlq"} <= {command.split()[1] for command in commands}
    for command in commands:
        run = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            env=stack.env(),
            cwd=ROOT,
            timeout=60,
        )
        assert run.returncode == 0, (command, run.stderr)
