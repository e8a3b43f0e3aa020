"""The upgrade soak's processes: the previous release's code beside this checkout's.

The previous release is checked out from this repository's history (`git archive`) into a
folder of its own. Its processes run with the same interpreter and installed packages, but
from that folder (working directory and `PYTHONPATH`), so `import outbox` and `import worker`
find the release's packages, not this checkout's editable install. Each process first prints
where its `outbox` and `worker` come from (`BOOT`), and the soak checks every process's line
against the code it meant to run (`code_problems`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from outbox.store.ports import free_port
from tests.chaos.servers import Fleet, Proc
from tests.support import ROOT, libpq

# Release 0.3.0 (CHANGELOG.md, 2026-12-02). The repository has no tags, so the commit is named
# here: the last commit of 2026-12-02, the one before the first change of 0.4.0 (on
# 2026-12-04), whose migrations end at 0015 (0.4.0 added 0016 to 0019). CI checks out the
# whole history, so `git archive` finds it.
PREVIOUS_RELEASE = "0.3.0"
PREVIOUS_COMMIT = "56ba1cd932f911d5330bf6f1e58035e7f2ccfe62"
PREVIOUS_SCHEMA = "0015"
OLD, NEW = "old", "new"

# Run as `python -c BOOT module args...`: say where the packages come from, then run `module`
# as `python -m module args...` would.
BOOT = """\
import importlib.util, json, runpy, sys
print(json.dumps({"event": "upgrade.code",
                  "outbox": importlib.util.find_spec("outbox").origin,
                  "worker": importlib.util.find_spec("worker").origin}), flush=True)
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def check_out(commit: str, folder: Path) -> Path:
    """The tree of `commit`, from this repository's history, written into `folder`."""
    folder.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit], stdout=subprocess.PIPE
    )
    assert archive.stdout is not None
    untar = subprocess.run(["tar", "-x", "-C", str(folder)], stdin=archive.stdout, check=False)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise RuntimeError(
            f"git archive {commit} failed: the upgrade soak needs the repository's history"
            " (a full clone, not a shallow one)"
        )
    return folder


def schema_revision(database_url: str) -> str:
    """The revision Alembic recorded in the database ("" before any migration)."""
    with psycopg.connect(libpq(database_url), autocommit=True, connect_timeout=5) as conn:
        exists = conn.execute("SELECT to_regclass('alembic_version') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return ""
        rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    return ",".join(sorted(str(row[0]) for row in rows))


@dataclass
class VersionedFleet(Fleet):
    """The soak's fleet, each process on the code of its role's current version
    (`running[role]`, OLD until its role is upgraded), and each receiver on a port of its
    own, so that one can be replaced while the other serves."""

    trees: dict[str, Path] = field(default_factory=dict)  # version -> its code's folder
    running: dict[str, str] = field(default_factory=dict)  # role -> version of its next start
    version_of: dict[str, str] = field(default_factory=dict)  # process name -> its version
    ports: dict[str, int] = field(default_factory=dict)  # receiver's name -> its port

    def command(self, role: str, args: list[str]) -> tuple[list[str], Path, dict[str, str]]:
        tree = self.trees[self.running.get(role, OLD)]
        assert args[0] == "-m", args
        return [sys.executable, "-c", BOOT, *args[1:]], tree, {"PYTHONPATH": str(tree)}

    def _spawn(self, role: str, args: list[str], extra: dict[str, str] | None = None) -> Proc:
        proc = super()._spawn(role, args, extra)
        self.version_of[proc.name] = self.running.get(role, OLD)
        if role == "receiver":
            self.ports[proc.name] = self.receiver_port
        return proc

    def start_receiver(self) -> Proc:
        self.receiver_port = free_port()
        return super().start_receiver()

    def url(self, proc: Proc) -> str:
        return f"http://127.0.0.1:{self.ports[proc.name]}"

    def migrate(self, version: str) -> tuple[float, int, str]:
        """`idem migrate` with `version`'s code: (seconds, exit code, its output)."""
        tree = self.trees[version]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", BOOT, "outbox.cli", "migrate"],
            env={**self.env, "PYTHONPATH": str(tree)},
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        output = done.stdout + done.stderr
        with (self.log_dir / f"migrate-{version}.log").open("a") as log:
            log.write(output)
        return time.monotonic() - started, done.returncode, output

    def code_problems(self) -> list[str]:
        """Every process whose first line does not name its version's `outbox` and `worker`
        packages (or that never printed one)."""
        problems = []
        for name, version in self.version_of.items():
            tree = self.trees[version].resolve()
            found = _boot_line(self.log_dir / f"{name}.log")
            if found is None:
                problems.append(f"{name} ({version}): no code line in its log")
                continue
            for package in ("outbox", "worker"):
                origin = Path(str(found.get(package))).resolve()
                if not origin.is_relative_to(tree / package):
                    problems.append(f"{name} ({version}): {package} from {origin}")
        return problems


def _boot_line(path: Path) -> dict[str, str] | None:
    with path.open(errors="replace") as log:
        for line in log:
            if '"upgrade.code"' in line:
                found: dict[str, str] = json.loads(line)
                return found
    return None
