"""The worker's metrics endpoint says why it is not served."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from worker import metrics


def test_a_taken_port_is_reported_with_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve() on a port another socket holds returns a reason naming the port."""
    monkeypatch.setenv(metrics.ENV, str(tmp_path))
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        reason = metrics.serve(port)
    assert reason is not None
    assert f"port {port}" in reason
