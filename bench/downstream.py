"""A fake downstream that answers every request after a fixed delay, like a CRM or a mail API.

`python -m bench.downstream --port P --delay 0.1`: a bare ASGI app under uvicorn (one process,
one event loop), so any number of requests wait at once and the delay, not this server, is what
a caller measures. Every POST gets 200 with `{"id": "<n>"}` after `--delay` seconds; `GET
/count` answers the number of POSTs so far.
"""

from __future__ import annotations

import argparse
import asyncio

from bench.asgi import Receive, Scope, Send, answer_lifespan


class SlowDownstream:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.count = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "GET":
            body = str(self.count).encode()
        else:
            self.count += 1
            number = self.count
            await asyncio.sleep(self.delay)
            body = b'{"id":"' + str(number).encode() + b'"}'
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, required=True)
    args = parser.parse_args()
    uvicorn.run(
        SlowDownstream(args.delay),
        host="127.0.0.1",
        port=args.port,
        log_config=None,
        access_log=False,
        server_header=False,
        # Many callers at once: the worker's threads and the naive worker's, all kept alive.
        backlog=4096,
        limit_concurrency=None,
    )


if __name__ == "__main__":
    main()
