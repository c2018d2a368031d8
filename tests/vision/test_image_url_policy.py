"""Image URLs reach only where jfire.vision.url_policy allows: public addresses by default,
checked after resolution and on every redirect, at the address that was checked.

Only loopback is ever contacted, even by a failing test: a guard (`no_stray_network`) stops and
records any connection or name lookup for anything else, and every test ends by asserting there
was none. Private, link-local and metadata addresses are tested with stand-in resolvers and URLs
naming them, refused by the address check before a connection is attempted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from jfire.errors import JfireError, RequestError
from jfire.vision.images import ImageLimits, load_images, pinned_request
from jfire.vision.url_policy import UrlPolicy, is_public_address, normalized_domain
from tests.vision.test_images import PARAM, PNG, data_url, server  # noqa: F401  (fixture)

LOOPBACK = ("127.0.0.1", "::1")
NOT_PUBLIC = [
    "10.0.0.1", "172.16.0.1", "172.31.255.254", "192.168.1.1",  # private (RFC 1918)
    "127.0.0.1", "127.1.2.3", "::1",  # loopback
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192",  # cloud metadata services
    "169.254.1.1", "fe80::1",  # link-local
    "fc00::1", "fd12:3456::1",  # unique-local
    "0.0.0.0", "0.1.2.3", "::",  # unspecified, "this network"
    "224.0.0.1", "239.255.255.250", "ff02::1", "ff0e::1",  # multicast
    "100.64.0.1", "198.18.0.1", "240.0.0.1", "255.255.255.255", "192.0.2.1", "fec0::1", "2001:db8::1",  # reserved
    "::ffff:10.0.0.1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:0.0.0.0",  # IPv4-mapped
    "::a00:1", "::7f00:1",  # IPv4-compatible
    "64:ff9b::a00:1", "64:ff9b::7f00:1", "2002:a00:1::1", "2002:7f00:1::", "2001::1",  # NAT64, 6to4, Teredo
]  # fmt: skip
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]


# -- the guard and the servers -----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_stray_network(monkeypatch):
    """Refuses (and records) every connection to, and every name lookup of, anything but loopback."""
    strays: list[str] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def is_loopback(host) -> bool:
        try:
            return ipaddress.ip_address(str(host).partition("%")[0]).is_loopback
        except ValueError:
            return host == "localhost"  # /etc/hosts

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address[0]):
            strays.append(f"connect {address}")
            raise ConnectionRefusedError(f"the test guard refused a connection to {address}")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not is_loopback(host):
            strays.append(f"getaddrinfo {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, f"the test guard refused to look up {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    assert strays == [], "something beyond loopback was contacted"


@pytest.fixture(scope="module")
def internal():
    """An internal service on 127.0.0.1 that answers any GET with an image, recording each."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], hits
    httpd.shutdown()
    httpd.server_close()


class Resolver:
    """A stand-in for getaddrinfo: each name's answers in turn (the last one repeated), recording
    every lookup."""

    def __init__(self, **answers: list[str] | list[list[str]]):
        self.answers = {name.replace("_", "."): a if isinstance(a[0], list) else [a] for name, a in answers.items()}
        self.calls: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if host not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        turns = self.answers[host]
        return turns[min(len(self.calls_of(host)) - 1, len(turns) - 1)]

    def calls_of(self, host: str) -> list[tuple[str, int]]:
        return [call for call in self.calls if call[0] == host]


class TrustingOneHost(UrlPolicy):
    """The default policy, except that one host name may lead to any address: a stand-in for a
    public host, which the tests cannot reach."""

    def address_allowed(self, host, address):
        return host == "public.test" or super().address_allowed(host, address)


def load_all(urls: list[str], policy: UrlPolicy, timeout: float = 2.0) -> list:
    limits = ImageLimits(fetch_timeout_s=timeout, url_policy=policy)
    return asyncio.run(load_images(urls, limits, [PARAM] * len(urls)))


def refusal(url: str, policy: UrlPolicy) -> RequestError:
    with pytest.raises(RequestError) as caught:
        load_all([url], policy)
    assert caught.value.param == PARAM
    return caught.value


def uniform(error: RequestError, url: str) -> tuple[str, str | None]:
    """The refusal with the URL the client sent taken out: the same for every refused destination."""
    assert url in str(error)
    return str(error).replace(url, "URL"), error.code


UNIFORM = (
    "could not fetch the image at URL: this server cannot reach that host or does not fetch from it (image URLs "
    "must lead to public hosts); send the image inline as a data URL (data:image/png;base64,<the file's bytes in "
    "base64>)",
    "image_fetch_failed",
)


def url_of(address: str, port: int = 80, path: str = "/image.png") -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}{path}"


def redirect_to(base: str, target: str) -> str:
    return f"{base}/to/{urllib.parse.quote(target, safe='')}"


# -- refusals ----------------------------------------------------------------------------------------


def test_internal_destinations_and_failed_connections_are_refused_alike(server, internal):  # noqa: F811
    """127.0.0.1 named outright, a name that resolves to it, a redirect to localhost from a host
    that may be fetched, and a port where nothing listens: one message, one code, and the
    internal service is never asked for anything."""
    base, state = server
    port, hits = internal
    public = base.replace("127.0.0.1", "public.test")  # the test server, standing in for a public host
    resolver = Resolver(public_test=["127.0.0.1"], images_internal_test=["127.0.0.1"], rebound_test=["10.0.0.1"])
    policy = TrustingOneHost(resolver=resolver)
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    before = len(state.requests)
    urls = [
        url_of("127.0.0.1", port, "/admin/secret.png"),
        url_of("::ffff:127.0.0.1", port, "/admin/secret.png"),
        f"http://localhost:{port}/admin/secret.png",  # resolved by the system resolver (/etc/hosts)
        f"http://images.internal.test:{port}/admin/secret.png",
        redirect_to(public, f"http://localhost:{port}/admin/secret.png"),
        redirect_to(public, f"http://127.0.0.1:{port}/admin/secret.png"),
        redirect_to(public, f"http://images.internal.test:{port}/admin/secret.png"),
        redirect_to(public, f"http://rebound.test:{port}/admin/secret.png"),
        "http://no-such-host.test/picture.png",  # does not resolve
        f"http://public.test:{closed}/picture.png",  # resolves to an allowed address; nothing listens
    ]
    for url in urls:
        assert uniform(refusal(url, policy), url) == UNIFORM, url
    assert hits == []
    # The stand-in for the public host was asked for its redirects, and nothing else was.
    assert [path[:4] for path, _ in state.requests[before:]] == ["/to/"] * 4


@pytest.mark.parametrize("address", NOT_PUBLIC)
def test_non_public_addresses_are_refused_by_the_address_check(address):
    """Named in the URL or resolved from a name: refused before any connection is attempted
    (the guard would record one)."""
    assert not is_public_address(ipaddress.ip_address(address))
    resolver = Resolver(victim_test=[address])
    for url in (url_of(address), "http://victim.test/image.png", "https://victim.test:8443/image.png"):
        assert uniform(refusal(url, UrlPolicy(resolver=resolver)), url) == UNIFORM
    assert resolver.calls == [("victim.test", 80), ("victim.test", 8443)]  # the address itself is never looked up


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass_the_address_check(address):
    assert is_public_address(ipaddress.ip_address(address))


def test_a_name_with_any_internal_address_is_fetched_only_from_a_public_one():
    """Every answer is judged and only an allowed one is used; none allowed: refused."""
    policy = UrlPolicy(resolver=Resolver(mixed_test=["10.0.0.1", "169.254.169.254", "::1"]))
    assert uniform(refusal("http://mixed.test/x.png", policy), "http://mixed.test/x.png") == UNIFORM


def test_a_scoped_link_local_address_is_not_used():
    assert not is_public_address(ipaddress.ip_address("fe80::1%eth0"))
    policy = UrlPolicy(allow_private=True, resolver=Resolver(scoped_test=["fe80::1%eth0"]))
    assert uniform(refusal("http://scoped.test/x.png", policy), "http://scoped.test/x.png") == UNIFORM


# -- what is allowed ---------------------------------------------------------------------------------


def test_private_addresses_are_fetched_only_when_allowed(server):  # noqa: F811
    base, _ = server
    url = f"{base}/img/png"
    assert uniform(refusal(url, UrlPolicy()), url) == UNIFORM
    assert (
        load_all([url], UrlPolicy(allow_private=True))[0].content_hash
        == load_all([data_url(PNG)], UrlPolicy())[0].content_hash
    )


def test_allowed_domains_cover_their_subdomains_on_every_hop(server):  # noqa: F811
    base, _ = server
    port = base.rpartition(":")[2]
    names = ("example.test", "cdn.example.test", "badexample.test", "example.test.evil.test", "other.test")
    resolver = Resolver(**{name.replace(".", "_"): ["127.0.0.1"] for name in names})
    policy = UrlPolicy(allowed_domains=("Example.TEST.",), allow_private=True, resolver=resolver)
    for host in ("example.test", "cdn.example.test", "EXAMPLE.test"):
        assert load_all([f"http://{host}:{port}/redirect/1/png"], policy)[0].size == (48, 32)
    for url in (
        f"http://badexample.test:{port}/img/png",
        f"http://example.test.evil.test:{port}/img/png",
        f"http://127.0.0.1:{port}/img/png",
        redirect_to(f"http://example.test:{port}", f"http://other.test:{port}/img/png"),
        redirect_to(f"http://example.test:{port}", f"http://127.0.0.1:{port}/img/png"),
    ):
        assert uniform(refusal(url, policy), url) == UNIFORM, url
    assert not resolver.calls_of("badexample.test") and not resolver.calls_of("other.test")  # refused by name
    # An IP address in the list allows that address only; private ones still need the opt-in.
    assert load_all([f"http://127.0.0.1:{port}/img/png"], UrlPolicy(("127.0.0.1",), allow_private=True))
    assert uniform(refusal(f"{base}/img/png", UrlPolicy(("127.0.0.1",))), f"{base}/img/png") == UNIFORM


def test_allowed_domain_entries_are_normalized_or_refused():
    assert normalized_domain(" Example.COM. ") == "example.com"
    assert normalized_domain("bücher.example") == "xn--bcher-kva.example"
    assert normalized_domain("[::1]") == normalized_domain("0:0::1") == "::1"
    for bad in ("https://example.com", "example.com:443", "*.example.com", "example.com/images", "", "."):
        with pytest.raises(JfireError, match="allowed image domain"):
            normalized_domain(bad)


# -- pinning -----------------------------------------------------------------------------------------


def test_each_host_is_resolved_once_and_connected_at_the_checked_address(server):  # noqa: F811
    """A resolver whose answer changes after the first lookup (127.0.0.2: loopback, but nothing
    listens there) cannot steer the fetch: redirects to the same host and a second image from it
    use the first answer, and the Host header is the name the URL gave."""
    base, state = server
    port = int(base.rpartition(":")[2])
    resolver = Resolver(pinned_test=[["127.0.0.1"], ["127.0.0.2"]])
    policy = UrlPolicy(allow_private=True, resolver=resolver)
    before = len(state.requests)
    loaded = load_all([f"http://pinned.test:{port}/redirect/3/png", f"http://pinned.test:{port}/img/png"], policy)
    assert loaded[0].content_hash == loaded[1].content_hash
    assert resolver.calls == [("pinned.test", port)]
    assert {host for _, host in state.requests[before:]} == {f"pinned.test:{port}"}
    assert len(state.requests) - before == 5  # three redirects, the image, the second image


def test_a_pinned_request_goes_to_the_address_and_names_the_host():
    """The connection's address is the checked one; Host, TLS's server name and so its
    certificate check are the URL's host name."""

    async def build():
        async with httpx.AsyncClient() as client:
            v4 = pinned_request(
                client, httpx.URL("https://images.example.test/a.png?x=1"), ipaddress.ip_address("93.184.216.34")
            )
            v6 = pinned_request(
                client, httpx.URL("http://bücher.example:8080/a.png"), ipaddress.ip_address("2606:4700::1")
            )
            literal = pinned_request(
                client, httpx.URL("https://93.184.216.34/a.png"), ipaddress.ip_address("93.184.216.34")
            )
        return v4, v6, literal

    v4, v6, literal = asyncio.run(build())
    assert str(v4.url) == "https://93.184.216.34/a.png?x=1"
    assert v4.headers["Host"] == "images.example.test" and v4.extensions["sni_hostname"] == "images.example.test"
    assert str(v6.url) == "http://[2606:4700::1]:8080/a.png" and v6.headers["Host"] == "xn--bcher-kva.example:8080"
    assert "sni_hostname" not in literal.extensions and literal.headers["Host"] == "93.184.216.34"
