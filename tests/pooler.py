"""PgBouncer for the tests: one of the test's own, in transaction mode, on a free port.

With TEST_POOLER=pgbouncer the processes of every stack on the machine's PostgreSQL reach it
through one such pool per test process (DATABASE_POOL_MODE=transaction, the sweeper through
DATABASE_DIRECT_URL; a stack on a server of its own goes direct), while the tests' own queries
go to the database itself: `make test` through a transaction pool.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from outbox.store.ports import free_port, wait_for_port

POOLER = os.environ.get("TEST_POOLER", "")

# Fewer server connections than the stack's processes open: transactions share them.
SERVER_CONNECTIONS = 3


@dataclass
class Bouncer:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path


def binary() -> str:
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if found is None:
        pytest.skip("no pgbouncer binary (make pgbouncer installs Debian's)")
    return found


@contextlib.contextmanager
def pgbouncer(
    database_url: str, connect_query: str | None, server_connections: int = SERVER_CONNECTIONS
) -> Iterator[Bouncer]:
    """A PgBouncer in transaction mode on a free port in front of `database_url`'s server,
    with `connect_query` run on each server connection it opens."""
    program = binary()
    target = make_url(database_url)
    folder = Path(tempfile.mkdtemp(prefix="idem-pgbouncer-"))
    # PgBouncer refuses to run as root: it drops to postgres, who must read its files.
    folder.chmod(0o755)
    port = free_port()
    query_option = f" connect_query='{connect_query}'" if connect_query else ""
    config = folder / "pgbouncer.ini"
    config.write_text(
        f"""
[databases]
* = host={target.host or "127.0.0.1"} port={target.port or 5432}{query_option}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "users.txt"}
pool_mode = transaction
default_pool_size = {server_connections}
max_client_conn = 500
""",
        encoding="utf-8",
    )
    # Clients are trusted; the password is the one PgBouncer logs in to the server with.
    user, password = target.username or "postgres", target.password or ""
    (folder / "users.txt").write_text(f'"{user}" "{password}"\n')
    for path in folder.iterdir():
        path.chmod(0o644)
    command = [program, str(config)]
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")  # the user Debian's PostgreSQL runs as
        except KeyError:
            pytest.skip("pgbouncer refuses to run as root, and there is no user postgres")
        command[1:1] = ["-u", "postgres"]
    log = folder / "pgbouncer.log"
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out)
    try:
        wait_for_port(port, process, timeout=10)
        yield Bouncer(pooled_url(database_url, port), port, process, log)
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def pooled_url(database_url: str, port: int) -> str:
    """`database_url`'s database through the pool listening on `port`."""
    return str(make_url(database_url).set(host="127.0.0.1", port=port).render_as_string(False))
