"""`python -m bench.profile [--target receiver|worker|relay] [--seconds 10]`: where a process's CPU
time goes under load, sampled with py-spy (in .venv).

receiver: `idem serve` under closed-loop ingest at 64 connections (noop routes).
ceiling: the bench's bare uvicorn handler doing the same INSERTs, under the same load.
worker: the Celery worker's pool processes while receiver + relay + worker run end to end.
relay: the relay, under the same load.
`--fan-out N`: the events' route fans out to N noop destinations (section 10's shape), so each
event is N deliveries; a worker's units are then deliveries.
`--lanes N`: the events are updates of N contacts through a route with `order_by` and
`versions = "supersede"` (section 9's shape); a worker's units are then events finished
(`succeeded` or `superseded`).
`--downstream-ms MS`: the route is section 8's `http` action against the fake downstream
answering after MS milliseconds, and the worker runs with the default concurrency (the bench's
shape), so the profile shows what a request in flight costs the worker.

Writes a flame graph (SVG) and the raw collapsed stacks next to the JSON results, and prints
the frames with the most samples: by their own time (the innermost frame of a sample) and
inclusive (anywhere on the stack), for our code and for the libraries it calls.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from bench import ordered
from bench.infra import DEFAULT_ADMIN_URL, WorkerShape, noop_stack, scalar, worker_pool_default
from bench.load import Result, Spec, generate
from bench.procfs import children
from bench.slow import HTTP_ROUTES

RESULTS = Path(__file__).resolve().parent / "results"
RATE_HZ = 200


def py_spy() -> str:
    found = Path(sys.executable).with_name("py-spy")
    if found.exists():
        return str(found)
    on_path = shutil.which("py-spy")
    if on_path is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    return on_path


def record(
    pid: int, seconds: float, out: Path, fmt: str, subprocesses: bool, gil: bool = False
) -> None:
    command = [
        py_spy(),
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--rate",
        str(RATE_HZ),
        "--format",
        fmt,
        "--output",
        str(out),
        "--nonblocking",
    ]
    if subprocesses:
        command.append("--subprocesses")
    if gil:
        command.append("--gil")
    subprocess.run(command, check=True, capture_output=True)


LAYERS = {
    "psycopg": "psycopg (driver, libpq calls)",
    "sqlalchemy": "SQLAlchemy (engine, pool, async adapter)",
    "greenlet": "SQLAlchemy (engine, pool, async adapter)",
    "asyncio": "asyncio event loop",
    "selectors": "asyncio event loop",
    "uvicorn": "HTTP server (uvicorn, h11)",
    "h11": "HTTP server (uvicorn, h11)",
    "fastapi": "FastAPI / Starlette",
    "starlette": "FastAPI / Starlette",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic",
    "json": "json",
    "structlog": "logging (structlog, logging)",
    "logging": "logging (structlog, logging)",
    "prometheus_client": "prometheus_client",
    "outbox": "outbox (this project)",
    "worker": "worker (this project)",
    "celery": "Celery / kombu / billiard",
    "kombu": "Celery / kombu / billiard",
    "billiard": "Celery / kombu / billiard",
    "redis": "redis-py",
    "threading": "threading",
}


def frame_name(frame: str) -> str:
    """`function (path/file.py:line)` without the line: samples of one function together."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def layer(frame: str) -> str:
    where = frame.partition(" (")[2]
    top = where.split("/", 1)[0].split(".", 1)[0]
    return LAYERS.get(top, "other")


def summarize(raw: Path, top: int = 15, units: int = 0, rate_hz: int = RATE_HZ) -> str:
    """Where the samples are, from py-spy's raw (collapsed) output: by layer and function of
    the innermost frame (own time), and our own functions anywhere on the stack (inclusive).
    With `units` (requests or events handled while sampling), also milliseconds per unit."""
    layers: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    own: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    total = 0
    # One sample stack a line, split on newlines only: splitlines() also splits on the other
    # line breaks Unicode knows, which a frame's text may hold (one did, in a worker's stack).
    for line in raw.read_text().split("\n"):
        if not line:
            continue
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        total += count
        # With --subprocesses a child's stack starts with its parent's label, then its own.
        labels = sum(1 for f in stack.split(";") if f.startswith("process "))
        processes["child process" if labels > 1 else "the process itself"] += count
        frames = [frame_name(f) for f in stack.split(";") if " (" in f]
        if not frames:
            layers["(no Python frame: native code, GIL hand-over)"] += count
            continue
        own[frames[-1]] += count
        layers[layer(frames[-1])] += count
        for name in {layer(frame) for frame in frames}:
            anywhere[name] += count
        for frame in set(frames):
            if layer(frame).endswith("(this project)"):
                ours[frame] += count

    def share(count: int) -> str:
        text = f"{100 * count / max(total, 1):5.1f} %"
        if units:
            text += f"  {1000 * count / rate_hz / units:6.3f} ms"
        return text

    lines = [f"{total} samples at {rate_hz} Hz (SQLAlchemy's greenlets are stacks of their own)"]
    if units:
        lines.append(f"{units} units handled while sampling: {share(total)} per unit in all")
    sections = (
        ("by process", processes, 2),
        ("own time by layer", layers, len(layers)),
        (
            "by layer anywhere on the stack (inclusive; a sample counts once per layer)",
            anywhere,
            len(anywhere),
        ),
        (f"top {top} functions by own time", own, top),
        ("this project's functions, inclusive", ours, top),
    )
    for title, counter, limit in sections:
        lines.append(f"\n-- {title} --")
        for frame, count in counter.most_common(limit):
            lines.append(f"{share(count)}  {frame}")
    return "\n".join(lines)


def succeeded(url: str) -> int:
    """Keys finished: succeeded, or (ordered traffic) superseded by a newer version."""
    return int(
        scalar(
            url,
            "SELECT count(*) FROM idempotency_keys WHERE status IN ('succeeded', 'superseded')",
        )
    )


def fan_out_routes(destinations: int) -> str | None:
    """Every event fanned out to `destinations` noop destinations (none: None, noop routes)."""
    if destinations <= 0:
        return None
    names = [f"d{n}" for n in range(1, destinations + 1)]
    listed = ", ".join(f'"{name}"' for name in names)
    tables = [f'[[routes]]\nmatch = "*"\nname = "fanout"\nfan_out = [{listed}]\n']
    tables += [f'\n[[destinations]]\nname = "{name}"\naction = "noop"\n' for name in names]
    return "".join(tables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument(
        "--target", choices=["receiver", "ceiling", "worker", "relay"], default="receiver"
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--admin-url", default=DEFAULT_ADMIN_URL)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--summarize", type=Path, help="only summarize an existing raw file")
    parser.add_argument(
        "--fan-out", type=int, default=0, help="fan each event out to N noop destinations"
    )
    parser.add_argument(
        "--lanes", type=int, default=0, help="updates of N contacts through an ordered route"
    )
    parser.add_argument(
        "--downstream-ms",
        type=float,
        default=0.0,
        help="act with http against the fake downstream answering after this many ms",
    )
    parser.add_argument(
        "--gil",
        action="store_true",
        help="only the thread holding the GIL: where a process bound by its GIL spends its core",
    )
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    # --lanes: section 9's routes file, its updates sent to the ordered route.
    routes = ordered.ROUTES if args.lanes else fan_out_routes(args.fan_out)
    # Written once the downstream's port is known; the worker reads its routes as it starts.
    routes = routes if not args.downstream_ms else "# the http route follows\n"
    with noop_stack(args.admin_url, "profile", routes) as (procs, _):
        if args.downstream_ms:
            downstream = procs.start_downstream(args.downstream_ms / 1000) + "/tasks"
            procs.ready()
            procs.routes_file.write_text(HTTP_ROUTES.format(url=downstream), encoding="utf-8")
        url = procs.start_receiver()
        if args.target == "ceiling":
            url = procs.start_ceiling()
        if args.target in ("worker", "relay"):
            procs.start_relay()
            # The bench's shape (the worker's default pool and concurrency), as its sections run it.
            pool, concurrency = WorkerShape().resolved()
            procs.start_worker(concurrency=concurrency, pool=pool)
        procs.ready()

        def burst(seconds: float) -> Spec:
            if not args.lanes:
                return Spec(url=url, concurrency=args.concurrency, duration=seconds)
            return Spec(
                url=url,
                mode="lanes",
                lanes=args.lanes,
                event_type=ordered.KINDS["ordered"],
                concurrency=args.concurrency,
                duration=seconds,
            )

        generate(burst(3))
        pid = procs.pid(args.target)
        if args.target == "worker":
            pid = procs.pid("worker")
            if worker_pool_default() == "prefork":
                assert children(pid), "the worker has no pool processes"
        results: list[Result] = []
        load = threading.Thread(target=lambda: results.append(generate(burst(args.seconds + 2))))
        done_before = succeeded(procs.database_url)
        load.start()
        svg = args.out / f"profile-{args.target}.svg"
        raw = args.out / f"profile-{args.target}.txt"
        subprocesses = args.target == "worker"
        record(pid, args.seconds, raw, "raw", subprocesses, args.gil)
        done_during = succeeded(procs.database_url) - done_before
        load.join()
        # Requests answered (receiver, ceiling) or events finished (worker, relay) meanwhile.
        finished = args.target in ("worker", "relay")
        units = done_during if finished else round(results[0].rate * args.seconds)
        # A second, shorter pass for the picture (py-spy writes one format at a time).
        load = threading.Thread(
            target=generate,
            args=(burst(5),),
        )
        load.start()
        record(pid, 4, svg, "flamegraph", subprocesses, args.gil)
        load.join()
    print(summarize(raw, units=units))
    print(f"\nflame graph: {svg}\ncollapsed stacks: {raw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
