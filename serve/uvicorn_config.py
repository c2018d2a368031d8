"""The uvicorn configuration of every jfire HTTP server (`jfire serve`, a deployment's frontend,
its groups' control servers), with the limits that keep one client from holding the others up.

`ConnectionLimits`, the defaults and why:

- `max_connections` (uvicorn's `limit_concurrency`), default 2,048 and at least the waiting
  queue plus 64 (`for_queue`): more connections open, or more requests in progress, and a
  request gets 503 with Retry-After, in the API's JSON error shape. Above the engine's default
  queue (1,024 waiting and the running batch), so a loaded server answers the queue's 429 first.
- `keep_alive_s` (`timeout_keep_alive`), default 5 s, uvicorn's own: an idle connection between
  requests is closed after it.
- `header_timeout_s`, default 10 s: a connection must finish each request's line and headers
  within this long of its first byte (of opening, for the first request), or it is closed.
  uvicorn has no such timeout, so a client that sends half a request line held its connection
  for ever. It bounds the head only: a slow upload, or a long streamed response, once the
  headers are in, runs as long as it needs.
- `max_header_bytes` (`h11_max_incomplete_event_size`), default 16 KiB, h11's and Node's: a
  request line and headers larger than this get 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_CONNECTIONS = 2048


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    keep_alive_s: int = 5
    header_timeout_s: float = 10.0
    max_header_bytes: int = 16 << 10

    @classmethod
    def for_queue(cls, requests: int) -> ConnectionLimits:
        """Limits for a server whose engine may hold `requests` (its waiting queue and batch):
        each holds a connection while it waits, and probes need a few more."""
        return cls(max_connections=max(DEFAULT_MAX_CONNECTIONS, requests + 64))


def uvicorn_config(app, limits: ConnectionLimits | None = None, **kwargs) -> uvicorn.Config:
    """uvicorn's Config for `app` with `limits` (None: the defaults); `kwargs` as uvicorn.Config's."""
    limits = limits or ConnectionLimits()
    protocol = type("LimitedH11Protocol", (LimitedH11Protocol,), {"header_timeout_s": limits.header_timeout_s})
    return uvicorn.Config(
        app,
        http=protocol,
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **kwargs,
    )


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head (`header_timeout_s`), and
    its concurrency limit answered as the API answers errors."""

    header_timeout_s = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        # uvicorn's own check answers in plain text: `_over_limit` checks instead.
        limit, self.limit_concurrency = self.limit_concurrency, None
        if limit is not None:
            self.app = _over_limit(self.app, limit, self.connections, self.tasks)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def _follow_head(self) -> None:
        """Starts the deadline when a request's head is awaited (a new connection, or the first
        bytes after a response: uvicorn's keep-alive timer stops there), stops it once the head
        is in. Bytes that follow do not move it, however slowly they come."""
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
        else:
            self._stop_deadline()

    def _stop_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def _over_limit(app, limit: int, connections: set, tasks: set):
    """`app`, answering 503 while more than `limit` connections are open or requests run (this
    one's among them)."""
    body = json.dumps(
        {
            "error": {
                "message": f"the server is at its limit of {limit} connections; retry shortly",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]

    async def limited(scope, receive, send):
        if scope["type"] == "http" and (len(connections) > limit or len(tasks) > limit):
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return limited
