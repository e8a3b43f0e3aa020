"""Architecture checks on the source text: package boundaries, retry timing, module size."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = ROOT / "outbox"
WORKER = ROOT / "worker"
# STYLE.md "Not to copy": modules over ~400 lines; past this a module wants splitting.
MAX_MODULE_LINES = 400
# Celery's own retry timing (invariant 6: retries wait in the outbox, not in the broker).
# `\b` keeps `eta=` from matching words such as `meta=` or `beta=`.
CELERY_RETRY_TIMING = re.compile(r"\bcountdown\s*=|\beta\s*=|\.retry\(|autoretry_for|retry_backoff")


def python_files(*packages: Path) -> list[Path]:
    return sorted(path for package in packages for path in package.rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported_modules(tree: ast.AST) -> list[str]:
    """Absolute module names named by import statements (relative ones stay in their package)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_packages_have_python_files() -> None:
    """The checks below see the real packages (a wrong ROOT would make them pass vacuously)."""
    assert (OUTBOX / "__init__.py").is_file()
    assert (WORKER / "__init__.py").is_file()
    assert len(python_files(OUTBOX)) > 5
    assert len(python_files(WORKER)) > 5


@pytest.mark.parametrize("path", python_files(OUTBOX), ids=relative)
def test_outbox_never_imports_worker(path: Path) -> None:
    """No module in outbox/ imports `worker`: the relay sends tasks by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    offending = [
        name for name in imported_modules(tree) if name == "worker" or name.startswith("worker.")
    ]
    assert offending == [], f"{relative(path)} imports {offending}"


@pytest.mark.parametrize(
    ("source", "imports_worker"),
    [
        ("import worker", True),
        ("import worker.app as app", True),
        ("from worker import app", True),
        ("from worker.errors import classify", True),
        ("import workers", False),
        ("from outbox import worker_names", False),
        ("from . import worker", False),
        ("args = ['-m', 'worker']", False),
    ],
)
def test_import_check_detects_worker_imports(source: str, imports_worker: bool) -> None:
    """The import check flags `worker` imports and nothing else (strings in argv are fine)."""
    names = imported_modules(ast.parse(source))
    found = any(name == "worker" or name.startswith("worker.") for name in names)
    assert found is imports_worker


@pytest.mark.parametrize("path", python_files(OUTBOX, WORKER), ids=relative)
def test_no_celery_retry_timing(path: Path) -> None:
    """No module uses Celery countdown/eta/self.retry/autoretry_for/retry_backoff (invariant 6)."""
    hits = [
        f"{relative(path)}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if CELERY_RETRY_TIMING.search(line)
    ]
    assert hits == []


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("task.apply_async(args, countdown=5)", True),
        ("task.apply_async(args, eta=when)", True),
        ("raise self.retry(exc=exc)", True),
        ("@app.task(autoretry_for=(Exception,))", True),
        ("@app.task(retry_backoff=True)", True),
        ("meta={'a': 1}", False),
        ("beta = 2", False),
        ("available_at = now()", False),
    ],
)
def test_retry_timing_pattern(line: str, flagged: bool) -> None:
    """The Celery retry-timing pattern catches each forbidden form and not ordinary words."""
    assert bool(CELERY_RETRY_TIMING.search(line)) is flagged


@pytest.mark.parametrize("path", python_files(OUTBOX, WORKER), ids=relative)
def test_modules_are_at_most_400_lines(path: Path) -> None:
    """No module in outbox/ or worker/ is over 400 lines."""
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{relative(path)} has {lines} lines"


LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"


def test_import_contracts_are_kept() -> None:
    """The import contracts of pyproject.toml hold: contexts use core and store and never each
    other, the worker never imports a context, no import cycle (import-linter)."""
    result = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
