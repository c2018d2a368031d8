"""Where an image URL in a request may make the server connect.

A request can name any URL, so without a policy the server fetches for whoever can reach its API
from wherever the server can reach: its own loopback services, the private network behind it, a
cloud's metadata service (169.254.169.254, fd00:ec2::254), which hands out credentials. By
default only public addresses are contacted:

- A host is resolved once per request (`Destinations`), every address it resolves to is judged
  (`is_public_address`), and the connection goes to the address that was judged: nothing is
  resolved a second time, so a DNS answer that changes between check and connect (DNS rebinding)
  cannot steer the fetch. Each redirect hop goes through the same check.
- `UrlPolicy.allowed_domains`, when given, also restricts every hop to those host names; a name
  covers its subdomains ("example.com" allows "cdn.example.com"), an IP address only itself.
- `UrlPolicy.allow_private` lets loopback, private and link-local addresses through too: for a
  server on one's own machine fetching from a local image server. Any client of such a server
  can make it fetch from the machine and its network.

Nothing here says why a destination was refused to the client: the caller answers every refusal
and every connection failure alike (jfire.vision.images), so that the server cannot be used to
learn which internal hosts and ports exist.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
from collections.abc import Callable, Sequence

import httpx

from jfire.errors import JfireError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]  # (host, port) -> addresses, blocking like getaddrinfo

# Never contacted unless private addresses are allowed. Python's `is_global` misses some of these
# (multicast, 192.0.0.0/24 and fec0::/10 count as global in 3.11), so they are listed outright.
DENIED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"; 0.0.0.0 reaches the local host on Linux
        "10.0.0.0/8",  # private (RFC 1918)
        "100.64.0.0/10",  # shared address space (carrier NAT); Alibaba Cloud's metadata, 100.100.100.200
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local; the AWS, GCP and Azure metadata service, 169.254.169.254
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments; Oracle Cloud's metadata, 192.0.0.192
        "192.0.2.0/24",  # documentation
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",  # private
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation
        "203.0.113.0/24",  # documentation
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the broadcast address
    )
)
DENIED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/96",  # unspecified, loopback and the deprecated IPv4-compatible form (::a.b.c.d)
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",  # discard
        "2001::/23",  # IETF protocol assignments, Teredo among them
        "2001:db8::/32",  # documentation
        "fc00::/7",  # unique-local; the AWS metadata service, fd00:ec2::254
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: the last 32 bits are an IPv4 address


def is_public_address(address: Address) -> bool:
    """Whether `address` is a public unicast address. IPv6 forms that carry an IPv4 address
    (mapped ::ffff:a.b.c.d, NAT64 64:ff9b::a.b.c.d, 6to4 2002:...) are judged by that address,
    as that is where a connection to them ends up."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:  # fe80::1%eth0 and the like: local to one link by definition
            return False
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(embedded)
        denied: tuple = DENIED_V6
    else:
        denied = DENIED_V4
    return address.is_global and not address.is_multicast and not any(address in network for network in denied)


def ip_literal(host: str) -> Address | None:
    """`host` as an IP address when it is one written out (as a URL's host holds it), else None."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def normalized_domain(entry: str) -> str:
    """An `allowed_domains` entry in the form request hosts are compared in: lower case, IDNA
    (as httpx sends it), no trailing dot; an IP address in its canonical form."""
    text = entry.strip()
    address = ip_literal(text)
    if address is not None:
        return str(address)
    bad = next((c for c in text if c in "/:@?#*% \t"), None)
    if not text.strip(".") or bad is not None:
        shown = f"the character {bad!r}" if bad else "no name"
        raise JfireError(
            f"allowed image domain {entry!r} has {shown}; give host names such as example.com "
            "(which also allows its subdomains) or IP addresses, without scheme, port or path"
        )
    try:
        return httpx.URL(f"http://{text}/").raw_host.decode("ascii").rstrip(".")
    except (httpx.InvalidURL, UnicodeError) as e:
        raise JfireError(f"allowed image domain {entry!r} is not a valid host name ({e})") from None


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses the system resolver gives for `host` (blocking)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


@dataclasses.dataclass(frozen=True)
class UrlPolicy:
    """Which destinations image fetches may connect to (see the module's docstring).

    - allowed_domains: host names (each with its subdomains) and IP addresses every hop must be
      among; empty: any host whose address is allowed.
    - allow_private: also loopback, private, link-local, metadata and the other non-public
      addresses, for a server used on one's own machine or trusted network.
    - resolver: how host names become addresses (`resolve_host`; tests give a stand-in).
    """

    allowed_domains: tuple[str, ...] = ()
    allow_private: bool = False
    resolver: Resolver = dataclasses.field(default=resolve_host, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "allowed_domains", tuple(normalized_domain(d) for d in self.allowed_domains))

    def host_allowed(self, host: str) -> bool:
        """Whether `host` (a URL's host, IDNA-encoded) is among the allowed domains."""
        if not self.allowed_domains:
            return True
        host = host.lower().rstrip(".")
        address = ip_literal(host)
        if address is not None:
            return str(address) in self.allowed_domains
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains if ip_literal(d) is None)

    def address_allowed(self, host: str, address: Address) -> bool:
        """Whether a connection for `host` may go to `address`, one of the addresses it resolved to."""
        return self.allow_private or is_public_address(address)


class DestinationRefused(Exception):
    """A host the policy forbids, or that does not resolve; the message is for the server's log,
    never for the client."""


class Destinations:
    """The pinned address of each host the fetches of one request connect to: resolved once (by
    the first fetch that asks, the others waiting for that answer), checked, and reused for
    every later hop to the same host."""

    def __init__(self, policy: UrlPolicy):
        self.policy = policy
        self._pinned: dict[str, asyncio.Future[Address]] = {}

    async def address_of(self, host: str, port: int) -> Address:
        """The address to connect to for `host`, or DestinationRefused."""
        if not self.policy.host_allowed(host):
            raise DestinationRefused(f"{host} is not among the allowed image domains")
        if host not in self._pinned:
            answer = asyncio.ensure_future(self._checked_address(host, port))
            # Retrieved here so that a refusal nobody waits for any more (its request failed
            # on another image first) is not reported as an exception never retrieved.
            answer.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._pinned[host] = answer
        # Shielded: a fetch cancelled while it waits must not cancel the answer others wait for.
        return await asyncio.shield(self._pinned[host])

    async def _checked_address(self, host: str, port: int) -> Address:
        literal = ip_literal(host)
        if literal is not None:
            candidates = [literal]
        else:
            try:
                answers = await asyncio.to_thread(self.policy.resolver, host, port)
            except (OSError, UnicodeError) as e:
                raise DestinationRefused(f"{host} does not resolve ({e})") from None
            # An address with a zone (fe80::1%eth0) has no place in a URL's host, so it is not pinned.
            candidates = [a for a in map(ip_literal, answers) if a is not None and not getattr(a, "scope_id", None)]
        for address in candidates:
            if self.policy.address_allowed(host, address):
                return address
        shown = ", ".join(str(a) for a in candidates) or "no address"
        raise DestinationRefused(f"{host} resolves to {shown}, none of which image fetches may reach")
