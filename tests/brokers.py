"""RabbitMQ for the tests: a vhost of a test's own on the machine's RabbitMQ, or a node of its own.

The machine's RabbitMQ is $TEST_RABBITMQ_URL (default `amqp://guest:guest@127.0.0.1:5672/`).
A stack on it gets a vhost created for it with `rabbitmqctl` and deleted after it, so its
queue, Celery's control exchanges and their messages are nobody else's; no other vhost is
read or written. A test that stops or restarts the broker starts a node of its own instead
(`RabbitNode`): its own node name, ports, data and cookie, never the machine's broker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from kombu import Connection

from outbox.core.broker import task_queue
from outbox.store.ports import free_port, wait_for_port

RABBITMQ_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
# The node script of the Debian/Ubuntu package; the one on PATH there switches to the
# rabbitmq user, which could not write the test's folders.
NODE_SCRIPTS = ("/usr/lib/rabbitmq/bin/rabbitmq-server", "rabbitmq-server")
# A node boots in 5 to 10 s on a busy 2-core machine.
NODE_START_SECONDS = 90


def rabbitmq_unreachable() -> str | None:
    """Why the machine's RabbitMQ cannot be used (None: it answers on its port)."""
    parts = urlsplit(RABBITMQ_URL)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5672
    try:
        with socket.create_connection((host, port), timeout=1):
            return None
    except OSError as error:
        return f"no RabbitMQ at {host}:{port} (TEST_RABBITMQ_URL): {error}"


def _ctl(*args: str) -> None:
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        raise RuntimeError(
            "RabbitMQ answers but there is no rabbitmqctl on PATH: the RabbitMQ tests create "
            "a vhost of their own with it (they never use another vhost)"
        )
    run = subprocess.run([ctl, "-q", *args], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {run.stderr.strip()}")


def with_vhost(url: str, vhost: str) -> str:
    """`url` with its path naming `vhost` (quoted: `/` is `%2F`)."""
    parts = urlsplit(url)
    return parts._replace(path="/" + quote(vhost, safe="")).geturl()


@contextlib.contextmanager
def rabbitmq_vhost() -> Iterator[str]:
    """A vhost of the caller's own on the machine's RabbitMQ, its URL's user allowed in it;
    deleted with everything in it at the end."""
    name = f"idem-test-{uuid.uuid4().hex[:10]}"
    user = urlsplit(RABBITMQ_URL).username or "guest"
    _ctl("add_vhost", name)
    try:
        _ctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
        yield with_vhost(RABBITMQ_URL, name)
    finally:
        _ctl("delete_vhost", name)


def _connection(url: str) -> Any:
    return Connection(url, connect_timeout=5, transport_options={"read_timeout": 5})


def queued(url: str) -> int:
    """Messages ready in the task queue (which must exist)."""
    with _connection(url) as connection:
        declared = connection.channel().queue_declare(task_queue("amqp").name, passive=True)
        return int(declared.message_count)


def queue_exists(url: str, name: str) -> bool:
    with _connection(url) as connection:
        try:
            connection.channel().queue_declare(name, passive=True)
        except Exception as error:
            if getattr(error, "code", None) == 404:
                return False
            raise
        return True


def queue_type(url: str) -> str:
    """The task queue's type as the broker holds it: a declaration whose `x-queue-type`
    differs from the existing queue's is refused (406 PRECONDITION_FAILED), the same one
    passes. The queue must exist (a declaration would create it)."""
    assert queue_exists(url, task_queue("amqp").name)
    for kind in ("quorum", "classic"):
        with _connection(url) as connection:
            try:
                connection.channel().queue_declare(
                    task_queue("amqp").name,
                    durable=True,
                    auto_delete=False,
                    arguments={"x-queue-type": kind},
                )
            except Exception as error:
                if getattr(error, "code", None) == 406:
                    continue
                raise
            return kind
    return "unknown"


def purge(url: str) -> None:
    """Empty the task queue, if it exists (the shared stack's queue between tests)."""
    with _connection(url) as connection:
        channel = connection.channel()
        with contextlib.suppress(Exception):
            channel.queue_purge(task_queue("amqp").name)


class RabbitNode:
    """A rabbitmq-server node of the test's own: its name, AMQP and distribution ports, data,
    logs and Erlang cookie all under `base`; stopped and started again as the test likes, its
    data kept between starts (as a restarted server keeps its disk)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = free_port()
        self.dist_port = free_port()
        self.name = f"idem-test-{uuid.uuid4().hex[:8]}@localhost"
        self.process: subprocess.Popen[bytes] | None = None
        base.mkdir(parents=True, exist_ok=True)
        # The machine's /etc/rabbitmq files would name the machine's node and port.
        (base / "rabbitmq.conf").write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
        (base / "enabled_plugins").write_text("[].\n")
        (base / "rabbitmq-env.conf").write_text("")

    @staticmethod
    def script() -> str | None:
        """The node's start script, if this machine has RabbitMQ installed."""
        for candidate in NODE_SCRIPTS:
            found = shutil.which(candidate) if "/" not in candidate else candidate
            if found and os.access(found, os.X_OK):
                return found
        return None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HOME=str(self.base),
            RABBITMQ_NODENAME=self.name,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base / "log"),
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.base / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base / "enabled_plugins"),
            RABBITMQ_CONF_ENV_FILE=str(self.base / "rabbitmq-env.conf"),
            RABBITMQ_PID_FILE=str(self.base / "node.pid"),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    def start(self) -> RabbitNode:
        script = self.script()
        assert script is not None, "no rabbitmq-server script"
        with (self.base / "node.out").open("ab") as out:
            self.process = subprocess.Popen(
                [script], env=self.env(), stdout=out, stderr=out, start_new_session=True
            )
        wait_for_port(self.port, self.process, timeout=NODE_START_SECONDS)
        return self

    def stop(self) -> None:
        """A clean stop (SIGTERM: the node closes its queues and connections); SIGKILL to its
        process group if it takes longer than 30 s."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # The node's own processes (beam, epmd's registration) end with it.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _listening(self.port):
            time.sleep(0.1)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
