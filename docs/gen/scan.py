"""What the code names as it runs: error codes, metrics and log events, read from the source
(the syntax tree, never by running it: collectors need a database to be listed)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outbox", "worker")

METRIC_CLASSES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "CounterMetricFamily": "counter",
    "GaugeMetricFamily": "gauge",
    "HistogramMetricFamily": "histogram",
}
LOG_LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
LOGGERS = {"log", "logger", "_log"}
# Functions that build a problem from a code given as their first argument.
PROBLEM_BUILDERS = {"unauthorized"}


@dataclass
class Metric:
    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    module: str


@dataclass
class Use:
    """Where a name (an error code, a log event) is used, and how."""

    name: str
    statuses: set[int] = field(default_factory=set)
    levels: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
            yield module, ast.parse(path.read_text(encoding="utf-8"))


def _called(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _text(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _labels(call: ast.Call) -> tuple[str, ...]:
    candidates = [kw.value for kw in call.keywords if kw.arg in ("labelnames", "labels")]
    candidates += call.args[2:3]
    for node in candidates:
        if isinstance(node, ast.List | ast.Tuple):
            return tuple(t for t in (_text(e) for e in node.elts) if t is not None)
    return ()


def metrics() -> list[Metric]:
    """Every metric a collector of the gateway defines, by name."""
    found: dict[str, Metric] = {}
    for module, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or _called(node) not in METRIC_CLASSES:
                continue
            name = _text(node.args[0]) if node.args else None
            if name is None:
                continue
            documentation = _text(node.args[1]) if len(node.args) > 1 else None
            for kw in node.keywords:
                if kw.arg == "documentation":
                    documentation = _text(kw.value)
            kind = METRIC_CLASSES[_called(node)]
            found.setdefault(name, Metric(name, kind, documentation or "", _labels(node), module))
    return sorted(found.values(), key=lambda m: m.name)


def error_codes() -> dict[str, Use]:
    """Every error code a problem answer is raised with, its statuses and modules."""
    uses: dict[str, Use] = {}
    for module, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = _called(node)
            if called == "Problem" and len(node.args) >= 2:
                code, status_node = _text(node.args[1]), node.args[0]
            elif called in PROBLEM_BUILDERS and node.args:
                code, status_node = _text(node.args[0]), None
            else:
                continue
            if code is None:
                continue
            use = uses.setdefault(code, Use(code))
            if isinstance(status_node, ast.Constant) and isinstance(status_node.value, int):
                use.statuses.add(status_node.value)
            use.modules.add(module)
    return uses


def log_events() -> dict[str, Use]:
    """Every event name logged (`log.info("relay.published", …)`), its levels and modules."""
    uses: dict[str, Use] = {}
    for module, tree in _modules():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in LOG_LEVELS or not node.args:
                continue
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id in LOGGERS):
                continue
            event = _text(node.args[0])
            if event is None or " " in event:
                continue
            use = uses.setdefault(event, Use(event))
            use.levels.add(node.func.attr)
            use.modules.add(module)
    return dict(sorted(uses.items()))
