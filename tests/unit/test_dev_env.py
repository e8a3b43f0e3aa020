"""`idem dev`'s env file: what other `idem` commands read, and when a new `idem dev` may
replace it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from outbox.cli import _clear_stale_dev_env
from outbox.core.settings import dev_env_file, get_settings


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in ("DATABASE_URL", "REDIS_URL", "OPERATOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def _write(pid: int) -> None:
    dev_env_file().write_text(
        f"IDEM_DEV_PID={pid}\nDATABASE_URL=postgresql://from-the-file/db\n"
        f"OPERATOR_TOKEN={'t' * 40}\n"
    )


def test_settings_take_what_the_environment_leaves_unset_from_the_file(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the file present, unset settings come from it, and a variable that is set wins."""
    _write(os.getpid())
    assert get_settings().database_url == "postgresql://from-the-file/db"
    assert get_settings().operator_token == "t" * 40
    monkeypatch.setenv("DATABASE_URL", "postgresql://from-the-environment/db")
    get_settings.cache_clear()
    assert get_settings().database_url == "postgresql://from-the-environment/db"


def test_a_file_of_a_running_idem_dev_refuses_a_second_one(data_dir: Path) -> None:
    """While the process that wrote the file lives, another `idem dev` stops (exit 2) and the
    file stays."""
    _write(1)  # init: always alive, never this process
    with pytest.raises(typer.Exit) as stopped:
        _clear_stale_dev_env()
    assert stopped.value.exit_code == 2
    assert dev_env_file().exists()


def test_a_file_left_by_a_killed_idem_dev_is_removed(data_dir: Path) -> None:
    """A file whose writer is gone (killed, so it could not remove it) is removed."""
    _write(2**31 - 1)  # above any pid_max: no such process
    _clear_stale_dev_env()
    assert not dev_env_file().exists()
