"""What a process listens on, as `ss -ltnp` shows it: for tests that hold listeners to the
addresses they were given and to the table in docs/security.md."""

from __future__ import annotations

import ipaddress

import psutil


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket the process listens on, sorted. An IPv4 address that
    an IPv6 socket carries is given as IPv4 (gRPC's 127.0.0.1 is a socket on ::ffff:127.0.0.1)."""
    out = []
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            address = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
            mapped = getattr(address, "ipv4_mapped", None)
            out.append((str(mapped or address), conn.laddr.port))
    return sorted(out)
