"""`python -m tests.chaos.nfdelay`: delay and drop the packets of one NFQUEUE queue.

netem would be the usual tool for latency and loss on a link, but a kernel may be built without
it (CONFIG_NET_SCH_NETEM unset: the machine this soak was written on has no netem, prio or gact).
Netfilter's queue is there wherever iptables is: a rule `-j NFQUEUE --queue-num N` hands each
matching packet to this process, which answers with a verdict later. Holding the verdict is the
delay (uniform in delay ± jitter, per packet, so packets may be reordered as with netem's
jitter); a DROP verdict is the loss.

The process speaks nfnetlink_queue over a raw netlink socket (no library), in the network
namespace it was started in (`ip netns exec`), and asks for packet metadata only: the kernel
keeps the packet, so nothing is copied. Rules carry `--queue-bypass`, so packets pass undelayed
whenever no process is bound to the queue. On SIGTERM every held packet is let through at once,
then the process exits: a healed link does not drop what it held.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import struct
import time
from typing import Any

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NF_DROP, NF_ACCEPT = 0, 1
# Packets held at once; at 200 ms and a few thousand packets a second, far more than needed.
QUEUE_MAXLEN = 8192


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attrs: list[bytes], flags: int, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + b"".join(attrs)
    header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0)
    return header + body


class Queue:
    """One bound queue: packet ids in, verdicts out."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._configure([_attr(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0))], 1)
        self._configure([_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))], 2)
        self._configure([_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))], 3)

    def _configure(self, attrs: list[bytes], seq: int) -> None:
        self.sock.send(
            _message(NFQNL_MSG_CONFIG, self.number, attrs, NLM_F_REQUEST | NLM_F_ACK, seq)
        )
        data = self.sock.recv(65536)
        _, kind, _, _, _ = struct.unpack_from("=IHHII", data)
        if kind == NLMSG_ERROR:
            error = struct.unpack_from("=i", data, 16)[0]
            if error:
                raise OSError(-error, f"configuring NFQUEUE {self.number}")

    def packet_ids(self) -> list[int]:
        """The ids of the packets in one read of the socket."""
        data = self.sock.recv(1 << 20)
        ids = []
        offset = 0
        while offset + 16 <= len(data):
            length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                at, end = offset + 20, offset + length  # past nlmsghdr and nfgenmsg
                while at + 4 <= end:
                    attr_length, attr_kind = struct.unpack_from("=HH", data, at)
                    if attr_length < 4:
                        break
                    if attr_kind & 0x7FFF == NFQA_PACKET_HDR:
                        ids.append(struct.unpack_from("!I", data, at + 4)[0])
                    at += (attr_length + 3) & ~3
            offset += (length + 3) & ~3
        return ids

    def verdict(self, packet_id: int, verdict: int) -> None:
        attr = _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id))
        self.sock.send(_message(NFQNL_MSG_VERDICT, self.number, [attr], NLM_F_REQUEST))


def serve(queue: Queue, delay: float, jitter: float, loss: float, rng: random.Random) -> None:
    """Hold each packet for delay ± jitter, drop a `loss` share; until SIGTERM, then release."""
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    held: list[tuple[float, int, int]] = []  # (due, packet id, verdict)
    while not stopping:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([queue.sock], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            now = time.monotonic()
            for packet_id in queue.packet_ids():
                verdict = NF_DROP if rng.random() < loss else NF_ACCEPT
                due = now + max(0.0, delay + rng.uniform(-jitter, jitter))
                heapq.heappush(held, (due, packet_id, verdict))
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, packet_id, verdict = heapq.heappop(held)
            queue.verdict(packet_id, verdict)
    for _, packet_id, _ in held:
        queue.verdict(packet_id, NF_ACCEPT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.nfdelay", description=__doc__)
    parser.add_argument("--queue", type=int, required=True, help="the NFQUEUE number")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds each packet is held")
    parser.add_argument("--jitter", type=float, default=0.05, help="± seconds, uniform")
    parser.add_argument("--loss", type=float, default=0.0, help="share of packets dropped")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    queue = Queue(args.queue)
    print(f"nfdelay: queue {args.queue} bound", flush=True)
    serve(queue, args.delay, args.jitter, args.loss, random.Random(args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
