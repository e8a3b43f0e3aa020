"""A three-node RabbitMQ cluster on the HA soak's network namespaces.

Each node is the machine's `rabbitmq-server` started with everything of its own (node name
`rabbit@<its address>` with long names, its ports on its host's address, data, logs, config
and the cluster's Erlang cookie under the soak's folder), so the machine's own RabbitMQ on
127.0.0.1:5672 is never touched: each host's epmd and ports live in its network namespace.
The first node starts alone, the others join it (`rabbitmqctl join_cluster`). The task queue
is a quorum queue (outbox/core/broker.py), declared once all three run, so it has a member on
each node and survives the loss of one.

The gateway reaches the cluster with a failover list, `amqp://a//;amqp://b//;amqp://c//`,
which Celery and kombu try in turn when a connection fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.brokers import RabbitNode
from tests.chaos.netns import Network

AMQP_PORT = 5672
DIST_PORT = 25672
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"


@dataclass
class RabbitCluster:
    net: Network
    base: Path
    nodes: list[str]
    log_dir: Path | None = None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    cookie: str = field(default_factory=lambda: secrets.token_hex(16).upper())

    def name(self, node: str) -> str:
        return f"rabbit@{self.net.ip(node)}"

    def folder(self, node: str) -> Path:
        return self.base / node

    def env(self, node: str) -> dict[str, str]:
        folder, ip = self.folder(node), self.net.ip(node)
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(folder),
            "LC_ALL": "C.UTF-8",
            "RABBITMQ_USE_LONGNAME": "true",
            "RABBITMQ_NODENAME": self.name(node),
            "RABBITMQ_NODE_IP_ADDRESS": ip,
            "RABBITMQ_NODE_PORT": str(AMQP_PORT),
            "RABBITMQ_DIST_PORT": str(DIST_PORT),
            "RABBITMQ_MNESIA_BASE": str(folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(folder / "log"),
            "RABBITMQ_CONFIG_FILE": str(folder / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(folder / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(folder / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(folder / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(folder / "node.pid"),
        }

    def _prepare(self, node: str) -> None:
        folder = self.folder(node)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {self.net.ip(node)}:{AMQP_PORT}\n"
            # guest from the soak's other hosts (the cluster is on a private network).
            "loopback_users = none\n"
        )
        (folder / "enabled_plugins").write_text("[].\n")
        (folder / "rabbitmq-env.conf").write_text("")
        cookie = folder / ".erlang.cookie"
        cookie.write_text(self.cookie)
        cookie.chmod(0o400)

    def start(self, timeout: float = 120.0) -> None:
        for node in self.nodes:
            self._prepare(node)
        first, *others = self.nodes
        self.start_node(first)
        self.wait_port(first, timeout)
        for node in others:
            self.start_node(node)
        for node in others:
            self.wait_port(node, timeout)
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", self.name(first))
            self.ctl(node, "start_app")
        running = self.running(first)
        if len(running) != len(self.nodes):
            raise RuntimeError(f"the RabbitMQ cluster runs {running}")

    def start_node(self, node: str) -> None:
        script = RabbitNode.script()
        assert script is not None, "no rabbitmq-server script"
        log_path = self.log_dir / f"rabbitmq-{node}.log" if self.log_dir else Path(os.devnull)
        with open(log_path, "ab") as log:
            self.processes[node] = subprocess.Popen(
                [*self.net.on(node), script],
                env=self.env(node),
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def wait_port(self, node: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            process = self.processes[node]
            if process.poll() is not None:
                raise RuntimeError(f"rabbitmq on {node} exited with {process.returncode}")
            try:
                socket.create_connection((self.net.ip(node), AMQP_PORT), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"rabbitmq on {node} not listening after {timeout:g} s")

    def ctl(self, node: str, *args: str) -> str:
        run = subprocess.run(
            [*self.net.on(node), CTL, "-n", self.name(node), "-l", *args],
            env=self.env(node),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if run.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {node}: {run.stderr.strip()}")
        return run.stdout

    def running(self, node: str) -> list[str]:
        status: dict[str, Any] = json.loads(self.ctl(node, "cluster_status", "--formatter", "json"))
        return list(status.get("running_nodes", []))

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL every process on the node's host (the Erlang VM, its helpers and the epmd
        it started, which leaves the node's session): the machine lost at once."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.net.ns(node)], capture_output=True, text=True
        )
        pids = [int(pid) for pid in listed.stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process = self.processes.get(node)
        if process is not None:
            process.wait()
        return pids

    def url(self) -> str:
        """The failover list of every node, for Celery and kombu."""
        return ";".join(f"amqp://guest:guest@{self.net.ip(n)}:{AMQP_PORT}//" for n in self.nodes)

    def stop(self) -> None:
        """Kill every node, and keep each node's own log (partitions, elections, closed
        connections) beside the soak's logs."""
        for node in self.processes:
            self.kill_node(node)
        if self.log_dir is not None:
            for node in self.nodes:
                for log in sorted((self.folder(node) / "log").glob("*.log")):
                    shutil.copy(log, self.log_dir / f"rabbitmq-{node}-{log.name}")
