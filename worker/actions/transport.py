"""The http action's connections: kept-alive HTTP/1.1 connections of the standard library's
`http.client`, behind httpx's transport interface.

Why not httpx's own client and pool: with a hundred requests in flight from a thread each, the
client's layers (its auth, redirect and cookie steps, its pool's bookkeeping) cost the worker
more CPU than the rest of the attempt; a request through this transport costs about half
(docs/explanation/performance.md, "What keeps the worker's HTTP cheap"). The action still
speaks httpx: it builds an `httpx.Request`, gets an `httpx.Response` whose body it streams, and
every transport failure is raised as the httpx exception that `worker.errors.classify` knows,
so what counts as "not sent" or "uncertain" is exactly what it was:

    making the connection (TCP, name lookup, TLS)   ConnectTimeout, ConnectError: not sent
    writing the request                             WriteTimeout, WriteError
    reading the answer                              ReadTimeout, RemoteProtocolError, ReadError
    a header http.client refuses to write           LocalProtocolError: nothing sent

A connection serves one request at a time. After an answer read to its end it waits, idle, for
the next request to the same origin (newest first); one idle for `KEEPALIVE_SECONDS` or that the
server has closed (readable while idle) is closed instead of reused, as httpx's pool does, so a
request is not written into a connection the server is closing. Every close is a reset
(`RESET_ON_CLOSE`): a request given up mid-way is dropped by the kernel, not retransmitted to
land after the next attempt's lookup. No cookies are kept between requests and no redirect is
followed.

A proxy named in the environment (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, less `NO_PROXY`),
as httpx's client honoured it, is honoured here: such a request goes through httpx's own
transport with that proxy.
"""

from __future__ import annotations

import http.client
import select
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

# A connection is closed with a reset, not a FIN: the kernel drops what it has not delivered.
# A connection is closed only when idle (every answer read) or after a timeout or an error,
# when the request is given up: an uncertain attempt. Closed gracefully, the kernel would go
# on retransmitting such a request for minutes, and it could reach the downstream after the
# next attempt's lookup had found nothing: a second effect (docs/explanation/reliability.md,
# "Findings of the multi-host soak", 3).
RESET_ON_CLOSE = (socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

# httpx's default keep-alive expiry: under the 5 s most servers (Node's, n8n's) keep an idle
# connection open, so the server does not close one as a request is written into it.
KEEPALIVE_SECONDS = 5.0

# How much of an answer's body one read returns at most.
CHUNK_BYTES = 65_536

_DEFAULT_PORTS = {"http": 80, "https": 443}

Origin = tuple[str, str, int]


class KeepAlive(httpx.BaseTransport):
    """Kept-alive connections per origin (scheme, host, port), shared by the process's threads;
    no cap on how many: the worker's concurrency is the cap (worker/slots.py), and a request
    never waits for a connection."""

    def __init__(self) -> None:
        self._ssl = httpx.create_ssl_context()
        self._idle: dict[Origin, list[_Connection]] = {}
        self._lock = threading.Lock()
        self._proxied: dict[str, httpx.BaseTransport] = {}
        # Read once: a process's environment does not change under it.
        self._proxies: dict[str, str] = urllib.request.getproxies()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"the URL's scheme {url.scheme!r} is not http(s)")
        if not url.host:
            raise httpx.UnsupportedProtocol("the URL names no host")
        proxy = _proxy_for(self._proxies, url) if self._proxies else None
        if proxy is not None:
            return self._through(proxy).handle_request(request)
        # The host as it goes on the wire (an international name in its ASCII form).
        host = url.raw_host.decode("ascii")
        origin = (url.scheme, host, url.port or _DEFAULT_PORTS[url.scheme])
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        connection = self._reused(origin) or self._connected(origin, timeouts.get("connect"))
        try:
            answer = connection.exchange(request, timeouts.get("write"), timeouts.get("read"))
        except BaseException:
            connection.close()
            raise
        # As the bytes came (http.client decodes them as Latin-1): a header that is not ASCII
        # is the answer's, not a failure of ours.
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.getheaders()]
        return httpx.Response(
            answer.status,
            headers=headers,
            stream=_Body(self, origin, connection, answer),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": answer.reason.encode("latin-1"),
            },
            request=request,
        )

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
            proxied, self._proxied = self._proxied, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()
        for transport in proxied.values():
            transport.close()

    def keep(self, origin: Origin, connection: _Connection) -> None:
        """An answered connection waits for the next request to its origin; the ones idle
        past `KEEPALIVE_SECONDS` (the oldest, at the front) are closed meanwhile."""
        now = time.monotonic()
        connection.idle_since = now
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            expired = 0
            while expired < len(idle) and now - idle[expired].idle_since >= KEEPALIVE_SECONDS:
                expired += 1
            stale, idle[:expired] = idle[:expired], []
            idle.append(connection)
        for old in stale:
            old.close()

    def _reused(self, origin: Origin) -> _Connection | None:
        while True:
            with self._lock:
                idle = self._idle.get(origin)
                connection = idle.pop() if idle else None
            if connection is None or connection.usable():
                return connection
            connection.close()

    def _connected(self, origin: Origin, timeout: float | None) -> _Connection:
        scheme, host, port = origin
        if scheme == "https":
            made: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._ssl
            )
        else:
            made = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            made.connect()
        except TimeoutError as error:
            made.close()
            raise httpx.ConnectTimeout(f"connecting timed out: {error}") from error
        except OSError as error:  # refused, unreachable, no such name, a failed handshake
            made.close()
            raise httpx.ConnectError(f"could not connect: {error}") from error
        assert made.sock is not None
        made.sock.setsockopt(*RESET_ON_CLOSE)
        return _Connection(made)

    def _through(self, proxy: str) -> httpx.BaseTransport:
        with self._lock:
            transport = self._proxied.get(proxy)
            if transport is None:
                transport = self._proxied[proxy] = httpx.HTTPTransport(
                    proxy=proxy,
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                    socket_options=[RESET_ON_CLOSE],
                )
        return transport


class _Connection:
    """One http.client connection and when it last went idle."""

    def __init__(self, connection: http.client.HTTPConnection) -> None:
        self.connection = connection
        self.idle_since = 0.0

    def usable(self) -> bool:
        """Idle for less than the keep-alive time and not readable: a server that closed it
        (or sent something unasked) makes it readable."""
        sock = self.connection.sock
        if sock is None or time.monotonic() - self.idle_since >= KEEPALIVE_SECONDS:
            return False
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        return not poll.poll(0)

    def exchange(
        self, request: httpx.Request, write: float | None, read: float | None
    ) -> http.client.HTTPResponse:
        """Write the request as built (its headers as they are, Host included), then read the
        answer's status line and headers."""
        connection = self.connection
        assert connection.sock is not None
        try:
            connection.sock.settimeout(write)
            connection.putrequest(
                request.method,
                request.url.raw_path.decode("ascii"),
                skip_host=True,
                skip_accept_encoding=True,
            )
            for name, value in request.headers.raw:
                connection.putheader(name, value)
        except ValueError as error:  # a header name or value http.client will not write
            raise httpx.LocalProtocolError(f"the request could not be written: {error}") from error
        try:
            connection.endheaders(request.content or None)
        except TimeoutError as error:
            raise httpx.WriteTimeout(f"sending the request timed out: {error}") from error
        except OSError as error:
            raise httpx.WriteError(f"sending the request failed: {error}") from error
        connection.sock.settimeout(read)
        with _reading():
            return connection.getresponse()

    def close(self) -> None:
        self.connection.close()


class _Body(httpx.SyncByteStream):
    """The answer's body as it arrives; closed, the connection goes back to the transport when
    the body was read to its end and the server keeps it open, else it is reset."""

    def __init__(
        self,
        transport: KeepAlive,
        origin: Origin,
        connection: _Connection,
        answer: http.client.HTTPResponse,
    ) -> None:
        self._transport = transport
        self._origin = origin
        self._connection = connection
        self._answer = answer
        # Read to its end: only then may the connection carry another request.
        self._complete = False

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self._read():
            yield chunk

    def _read(self) -> bytes:
        answer = self._answer
        if answer.length == 0:  # the whole declared body is in (none, for HEAD, 204, 304)
            self._complete = True
            return b""
        with _reading():
            chunk = answer.read1(CHUNK_BYTES)
        if not chunk:
            if answer.length:  # http.client's read1 returns short without a word
                raise httpx.RemoteProtocolError("the connection closed mid-answer")
            self._complete = True
        return chunk

    def close(self) -> None:
        answer = self._answer
        answer.close()
        if self._complete and not answer.will_close:
            self._transport.keep(self._origin, self._connection)
        else:
            self._connection.close()


@contextmanager
def _reading() -> Iterator[None]:
    """Reading the answer (its head or its body): a failure as the httpx error it would be."""
    try:
        yield
    except TimeoutError as error:
        raise httpx.ReadTimeout(f"no answer within the read timeout: {error}") from error
    except http.client.HTTPException as error:  # no status line, bad headers, a broken chunk
        raise httpx.RemoteProtocolError(f"the answer was not read whole: {error!r}") from error
    except OSError as error:
        raise httpx.ReadError(f"reading the answer failed: {error}") from error


def _proxy_for(proxies: dict[str, str], url: httpx.URL) -> str | None:
    """The proxy the environment names for this URL, as httpx's client would have used it."""
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(url.host):
        return None
    return str(proxy)
