"""The listening socket of `jfire serve` and of a deployment's frontend, bound before anything
slow starts: a busy port is one line and exit status 2 within a second, not an error from
uvicorn after the model has loaded and programs have begun compiling."""

from __future__ import annotations

import socket

from jfire.errors import JfireError


def bind(host: str, port: int, what: str) -> socket.socket:
    """A socket bound to host:port (not yet listening; uvicorn listens on it), set up as uvicorn
    sets up its own (SO_REUSEADDR, so a port left in TIME_WAIT by the last run is usable)."""
    if not 0 <= port < 65536:
        raise JfireError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise JfireError(f"--host {host!r} is not an address this machine can listen on ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise JfireError(f"{what} cannot listen on {host}:{port}: {e.strerror}; pick another --port") from None
    return sock
