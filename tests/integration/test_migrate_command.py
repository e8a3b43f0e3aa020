"""`idem migrate`, the one-shot step compose runs before the app services, as a real process."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import ROOT, run_idem


def test_migrate_needs_the_database_only(own_database: str, tmp_path: Path) -> None:
    """With DATABASE_URL and nothing else (no broker, no routes, no token: what compose gives
    it), `idem migrate` brings the schema to head and exits 0."""
    keep = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR"}
    env = {name: value for name, value in os.environ.items() if name in keep}
    env.update(DATABASE_URL=own_database, PYTHONPATH=str(ROOT), DATA_DIR=str(tmp_path))
    done = run_idem("migrate", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "migrations.applied" in done.stdout + done.stderr
