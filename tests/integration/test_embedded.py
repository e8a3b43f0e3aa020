"""The embedded PostgreSQL, started by root, changes nothing outside its data folder."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox.store.embedded import UNPRIVILEGED_USER, postgres_binaries, start_postgres
from tests.support import libpq, system_state

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="what root's start changes (a system user, folder modes) needs root"
)


def _server_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # the effective uid
    raise AssertionError(f"no Uid line for {pid}")


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A folder every user may enter, as a project under /srv or /home would be."""
    folder = Path(tempfile.mkdtemp(prefix="idem-test-embedded-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _start_and_check(data_dir: Path) -> None:
    data_dir.parent.mkdir(parents=True, exist_ok=True)  # the project's folder and its .idem/
    before = system_state(data_dir, postgres_binaries())
    server, url = start_postgres(data_dir)
    try:
        with psycopg.connect(libpq(url)) as conn:
            assert conn.execute("SELECT 1 + 1").fetchone() == (2,)
        assert server.process is not None
        assert _server_uid(server.process.pid) == pwd.getpwnam(UNPRIVILEGED_USER).pw_uid
        assert system_state(data_dir, postgres_binaries()) == before
    finally:
        server.cleanup()
    assert system_state(data_dir, postgres_binaries()) == before


def test_root_start_under_an_open_folder_runs_as_nobody_and_changes_nothing_outside(
    open_parent: Path,
) -> None:
    """Under a folder others may enter, root's embedded PostgreSQL runs as `nobody` and leaves
    /etc/passwd, /etc/group, the mounts and every parent folder's mode and owner as they were."""
    _start_and_check(open_parent / ".idem" / "postgres")


def test_root_start_under_a_private_folder_opens_no_parent(tmp_path: Path) -> None:
    """Under a private folder (like /root, mode 700), the server still starts as `nobody`
    without opening that folder, adding a user or leaving a mount behind."""
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    _start_and_check(private / "project" / ".idem" / "postgres")


def test_a_restart_keeps_the_data_and_the_url(open_parent: Path) -> None:
    """A stopped embedded server starts again on its data directory with the same URL."""
    server, url = start_postgres(open_parent / "pg")
    try:
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (n int)")
        server.stop(fast=True)
        assert server.start() == url
        with psycopg.connect(libpq(url)) as conn:
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (0,)
    finally:
        server.cleanup()
