"""The connection limits every jfire HTTP server runs with (serve/uvicorn_config.py), on a tiny
FastAPI app in this process: a connection that never finishes its request's head is closed
at the header timeout, while a slow upload, a long stream and a keep-alive connection live as
long as they should; past the connection limit a request gets a JSON 503."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from jfire.disagg.launch import free_port
from serve.uvicorn_config import ConnectionLimits, uvicorn_config

HEAD_S = 0.5  # the header timeout here
KEEP_ALIVE_S = 2  # uvicorn's keep-alive timeout here: whole seconds


def tiny_app() -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    async def ping():
        return {"ok": True}

    @app.get("/stream")
    async def stream():
        async def chunks():
            for i in range(6):  # 1.5 s: three header timeouts
                await asyncio.sleep(0.25)
                yield f"{i}\n"

        return StreamingResponse(chunks(), media_type="text/plain")

    @app.post("/upload")
    async def upload(request: Request):
        return {"bytes": len(await request.body())}

    return app


def start(limits: ConnectionLimits):
    port = free_port()
    server = uvicorn.Server(uvicorn_config(tiny_app(), limits, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    return server, thread, port


@pytest.fixture(scope="module")
def port():
    server, thread, port = start(ConnectionLimits(keep_alive_s=KEEP_ALIVE_S, header_timeout_s=HEAD_S))
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def seconds_until_closed(sock: socket.socket, limit: float = 5.0) -> float:
    """Reads (and drops) what the server sends until it closes the connection."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    while sock.recv(4096):
        pass
    return time.monotonic() - t0


def response_of(sock: socket.socket) -> bytes:
    """One whole response to a GET whose body is small (read until the body's end)."""
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_a_connection_that_never_finishes_its_head_is_closed(port):
    for first_bytes in (b"", b"GET /pi", b"GET /ping HTTP/1.1\r\nHost: x\r\n"):
        with connect(port) as sock:
            sock.sendall(first_bytes)
            assert seconds_until_closed(sock) < HEAD_S + 1.5, first_bytes
    # A trickle of header lines does not move the deadline.
    with connect(port) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\n")
        t0, closed_after = time.monotonic(), None
        sock.settimeout(0.1)  # the pause between lines
        while closed_after is None and time.monotonic() - t0 < 4:
            try:
                sock.sendall(b"X-Slow: y\r\n")
                if sock.recv(4096) == b"":
                    closed_after = time.monotonic() - t0
            except TimeoutError:
                continue
            except OSError:  # reset, or a broken pipe: closed all the same
                closed_after = time.monotonic() - t0
        assert closed_after is not None and closed_after < HEAD_S + 1.5, closed_after
    # The server serves on.
    assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).json() == {"ok": True}


def test_a_slow_upload_and_a_long_stream_run_past_the_header_timeout(port):
    with connect(port) as sock:
        sock.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: 8\r\n\r\n")
        for _ in range(4):  # 1.2 s for the body
            time.sleep(0.3)
            sock.sendall(b"ab")
        assert b'{"bytes":8}' in response_of(sock)
    t0 = time.monotonic()
    with httpx.stream("GET", f"http://127.0.0.1:{port}/stream", timeout=10) as r:
        lines = list(r.iter_lines())
    assert lines == [str(i) for i in range(6)] and time.monotonic() - t0 > 2.5 * HEAD_S


def test_an_idle_keep_alive_connection_follows_the_keep_alive_timeout(port):
    with connect(port) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b'{"ok":true}' in response_of(sock)
        # Idle past the header timeout: still open, until the keep-alive timeout.
        idle = seconds_until_closed(sock, limit=KEEP_ALIVE_S + 3)
        assert KEEP_ALIVE_S - 0.5 < idle < KEEP_ALIVE_S + 1.5, idle
    with connect(port) as sock:
        # The next request's first bytes end the keep-alive wait: its head has the header timeout.
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b'{"ok":true}' in response_of(sock)
        sock.sendall(b"GET /ping HTTP/1.1\r\n")
        assert seconds_until_closed(sock) < HEAD_S + 1.0


def test_past_the_connection_limit_a_request_gets_a_json_503():
    server, thread, port = start(ConnectionLimits(max_connections=2, header_timeout_s=5))
    try:
        idle = [connect(port), connect(port)]
        time.sleep(0.2)  # accepted
        r = httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections", r.text
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)
