"""Images from requests: a chat part's `image_url.url` (a `data:` URL or an http(s) URL) or a
local file (the CLI's `--image PATH`) turned into a decoded RGB picture and a content hash,
under limits on bytes, pixels, time and count. Every bad input is a `RequestError` naming the
request field it is about; nothing here raises anything else for what a client sends. An
http(s) URL is fetched only from where jfire.vision.url_policy allows (public addresses by
default, on every redirect hop, at the address that was checked), and every refused destination
and failed connection gets the same answer (`unreachable`).

The decoded picture is what the models' HF image processors receive when handed
`PIL.Image.open(BytesIO(data))`: the first frame (GIF, animated WebP/PNG, MPO), converted by
transformers' `image_transforms.convert_to_rgb` (transparency composited onto white, anything
else `convert("RGB")`), with no EXIF rotation and no colour management. It is kept as a loaded
PIL image in mode "RGB" because both preprocessors (jfire.vision.llama4_preprocess and
kimi_k25_preprocess) take PIL images; `LoadedImage.pixels` gives the uint8 [H, W, 3] array.
transformers' own loaders for URL and base64 strings (`load_image`; `load_image_as_tensor`, which
the torchvision-backed processors use) differ: they apply the EXIF orientation, and
`load_image` drops alpha rather than composite it. jfire follows the PIL-input path, which its
preprocessors mirror.

Accepted formats: PNG, JPEG (and MPO, the multi-picture JPEG that phones write), WebP, GIF.
Others (BMP, TIFF, HEIC, AVIF, SVG, ...) are refused by name: each extra Pillow plugin that
parses untrusted bytes is extra attack surface, and OpenAI's API accepts these four.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import io
import logging
import os
import urllib.parse
from collections.abc import Sequence

import httpx
import numpy as np
from PIL import Image, UnidentifiedImageError

from jfire.errors import JfireError, RequestError
from jfire.vision.url_policy import Address, DestinationRefused, Destinations, UrlPolicy, ip_literal

# Pillow's names for the accepted formats; the JPEG opener itself returns MPO files as "MPO".
PILLOW_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
ACCEPTED = "PNG, JPEG, WebP and GIF"
DATA_URL_MEDIA_TYPES = (
    "image/png",
    "image/jpeg",
    "image/jpg",
    "image/webp",
    "image/gif",
)  # image/jpg: a common misspelling
DATA_URL_EXAMPLE = "data:image/png;base64,<the file's bytes in base64>"
FETCH_HEADERS = {
    "User-Agent": "jfire (image fetch)",  # some hosts refuse requests that name no client
    "Accept": "image/png, image/jpeg, image/webp, image/gif",
    # Image formats are compressed already; asking for no transfer encoding keeps a gzip bomb
    # from being inflated (a server may still send one: the byte limit counts decoded bytes).
    "Accept-Encoding": "identity",
}
WHITE = (255, 255, 255, 255)
log = logging.getLogger("jfire.vision")

# The first bytes of formats worth naming in a refusal; accepted ones too, so that a file that
# starts like a PNG but does not decode is reported as a corrupt PNG rather than "not an image".
SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"%PDF", "PDF"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"qoif", "QOI"),
)
ISO_MEDIA_BRANDS = {
    b"heic": "HEIC",
    b"heix": "HEIC",
    b"mif1": "HEIF",
    b"msf1": "HEIF",
    b"avif": "AVIF",
    b"avis": "AVIF",
}


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What one request may ask of the image loader.

    - max_bytes (20 MiB): the per-image size OpenAI's vision guide long stated; a phone photo
      is a few MB. The server's body limit must allow `max_images` data URLs of this size (base64
      adds a third).
    - max_pixels (50 M): a 48-50 MP phone photo (8064 x 6048) passes; its RGB is 150 MB while
      decoding. Both models see far fewer (Llama 4 at most 16 tiles of 336^2 = 1.8 MP, Kimi K2.5
      about 3.2 MP): anything larger is downscaled, so a higher limit only costs memory. Kept
      below Pillow's own bomb warning (89.5 MP), which therefore never fires for an accepted image.
    - fetch_timeout_s (10 s): connect, redirects and the whole body together, so a server that
      drips bytes cannot hold a request longer than this.
    - max_images (8): Llama 4 Scout was tested with up to 5 images; 8 images of 17 tiles each are
      about 20k placeholder tokens.
    - fetch_urls (on): off refuses http(s) URLs (a server that must not reach the network).
    - max_redirects (5): enough for CDN hops; each hop must stay http(s).
    - url_policy (public addresses only): where fetches may connect, checked on every hop
      (jfire.vision.url_policy.UrlPolicy: allowed domains, private addresses for local use).
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 50_000_000
    fetch_timeout_s: float = 10.0
    max_images: int = 8
    fetch_urls: bool = True
    max_redirects: int = 5
    url_policy: UrlPolicy = UrlPolicy()

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels", "fetch_timeout_s", "max_images"):
            if not getattr(self, name) > 0:
                raise JfireError(f"image limit {name} must be positive, got {getattr(self, name)}")
        if self.max_redirects < 0:
            raise JfireError(f"image limit max_redirects must be >= 0, got {self.max_redirects}")


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedImage:
    """A decoded picture: `image` is a loaded PIL image in mode "RGB"; `content_hash` (32 bytes)
    identifies its pixels whatever the encoding or transport, for the encoder and prefix caches;
    `source_format` is Pillow's name for what was sent ("PNG", "JPEG", "MPO", "WEBP", "GIF")."""

    image: Image.Image
    content_hash: bytes
    source_format: str

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), Pillow's order."""
        return self.image.size

    @property
    def pixels(self) -> np.ndarray:
        """uint8 [H, W, 3]."""
        return np.asarray(self.image)


def content_hash(image: Image.Image) -> bytes:
    """sha256 of the mode, the size and the pixel bytes. 32 bytes rather than 16: the hash keys
    caches shared between users, so a collision crafted by one must stay out of reach."""
    digest = hashlib.sha256(f"{image.mode} {image.width}x{image.height}\n".encode())
    digest.update(image.tobytes())
    return digest.digest()


# -- decoding --------------------------------------------------------------------------------------


def decode_image(data: bytes, limits: ImageLimits, param: str) -> LoadedImage:
    """The picture in `data` (an image file's bytes), checked against the byte and pixel limits;
    the pixel count is read from the header and checked before anything is decompressed."""
    if not data:
        raise RequestError("the image is empty (0 bytes)", param=param, code="invalid_image")
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(f"the image is {len(data)} bytes", limits, param)
    try:
        opened = Image.open(io.BytesIO(data), formats=PILLOW_FORMATS)
    except Image.DecompressionBombError:
        # Pillow refuses headers over 2 x MAX_IMAGE_PIXELS itself, before we can see the size.
        bomb = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        raise _too_many_pixels("the image declares more than", str(bomb), limits, param) from None
    except UnidentifiedImageError:
        raise _not_accepted(data, param) from None
    except Exception as e:  # a plugin parsing hostile bytes may raise nearly anything
        raise _corrupt(data, e, param) from None
    with opened:
        width, height = opened.size
        if width * height > limits.max_pixels:
            raise _too_many_pixels("the image is", f"{width}x{height} = {width * height}", limits, param)
        try:
            opened.load()
            rgb = to_rgb(opened)
        except Exception as e:
            raise _corrupt(data, e, param) from None
    return LoadedImage(rgb, content_hash(rgb), opened.format or "unknown")


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb` for PIL images, which the Llama 4 and Kimi K2.5 processors
    apply to a PIL input: transparency (an alpha band, or a palette or single colour marked
    transparent) is composited onto white; otherwise a plain `convert("RGB")`."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB")
    return image.convert("RGB")


def sniffed_format(data: bytes) -> str | None:
    """The format the first bytes announce, among those worth naming, else None."""
    for signature, name in SIGNATURES:
        if data.startswith(signature):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[4:8] == b"ftyp":
        return ISO_MEDIA_BRANDS.get(data[8:12])
    if data[:256].lstrip()[:5] in (b"<svg ", b"<?xml"):
        return "SVG"
    return None


def _not_accepted(data: bytes, param: str) -> RequestError:
    name = sniffed_format(data)
    if name is None:
        message = f"the bytes are not an image in an accepted format ({ACCEPTED})"
    elif name.upper() in PILLOW_FORMATS:
        message = f"the image starts like a {name} file but its header is corrupt or truncated"
    else:
        message = f"the image is {name}; accepted formats are {ACCEPTED}: convert it to one of them"
    return RequestError(message, param=param, code="invalid_image")


def _corrupt(data: bytes, error: Exception, param: str) -> RequestError:
    name = sniffed_format(data) or "image"
    detail = str(error)[:200] or type(error).__name__
    return RequestError(
        f"the {name} could not be decoded, it is corrupt or truncated ({detail}); send the whole file",
        param=param,
        code="invalid_image",
    )


def _too_many_bytes(what: str, limits: ImageLimits, param: str) -> RequestError:
    mib = f" ({limits.max_bytes / 2**20:g} MiB)" if limits.max_bytes >= 2**20 else ""
    return RequestError(
        f"{what}; the limit is {limits.max_bytes} bytes{mib} per image: send a smaller or more compressed image",
        param=param,
        code="image_too_large",
    )


def _too_many_pixels(what: str, count: str, limits: ImageLimits, param: str) -> RequestError:
    return RequestError(
        f"{what} {count} pixels; the limit is {limits.max_pixels} pixels ({limits.max_pixels / 1e6:g} megapixels) "
        "per image: downscale it (the models resize it to far fewer anyway)",
        param=param,
        code="image_too_large",
    )


# -- data: URLs ------------------------------------------------------------------------------------


def data_url_bytes(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes a base64 `data:` URL carries (RFC 2397), its media type one of the accepted ones.
    The declared type is not held against the content: clients mislabel, the bytes decide."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise _malformed_data_url("it has no comma between the header and the data", param)
    media_type, *parameters = (part.strip().lower() for part in header.split(";"))
    if "base64" not in parameters:
        raise _malformed_data_url("only base64 data URLs are accepted (';base64' is missing)", param)
    if media_type not in DATA_URL_MEDIA_TYPES:
        declared = f"media type {media_type!r}" if media_type else "no media type"
        raise RequestError(
            f"the data URL declares {declared}; accepted are image/png, image/jpeg, image/webp and image/gif, "
            f"as in {DATA_URL_EXAMPLE}",
            param=param,
            code="invalid_image",
        )
    # Refused before any copy is made: even percent-escaped and broken into lines, a payload
    # within the limit is under 3 characters per base64 character.
    if len(payload) > 3 * (limits.max_bytes * 4 // 3 + 4):
        raise _too_many_bytes(f"the data URL is {len(url)} characters long", limits, param)
    if "%" in payload:  # RFC 2397 allows percent-encoding; some clients escape '+', '/', '='
        payload = urllib.parse.unquote(payload)
    payload = "".join(payload.split())  # line breaks, as MIME base64 writers insert
    carried = (len(payload) - payload[-2:].count("=")) * 3 // 4  # the decoded size, padding aside
    if carried > limits.max_bytes:  # refused before decoding anything
        raise _too_many_bytes(f"the data URL holds {carried} bytes", limits, param)
    if len(payload) % 4:  # missing '=' padding is a common slip; a remainder of 1 stays invalid
        payload += "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _malformed_data_url(
            "its data is not valid base64 (A-Z, a-z, 0-9, '+', '/', '=' padding)", param
        ) from None


def _malformed_data_url(what: str, param: str) -> RequestError:
    return RequestError(
        f"malformed data URL: {what}; expected {DATA_URL_EXAMPLE}", param=param, code="invalid_image_url"
    )


# -- http(s) URLs ----------------------------------------------------------------------------------


def _shown(url: httpx.URL | str) -> str:
    """A URL short enough to quote in a message."""
    text = str(url)
    return text if len(text) <= 200 else text[:200] + "..."


def unreachable(url: str, param: str) -> RequestError:
    """The one answer for a URL the server may not or cannot connect to: a refused destination
    (an internal address, a host outside the allowed domains, including on a redirect), a name
    that does not resolve, a refused or timed-out connection. Telling them apart would let a
    client map which internal hosts and ports exist; only the URL the client sent is quoted."""
    return RequestError(
        f"could not fetch the image at {_shown(url)}: this server cannot reach that host or does not fetch "
        f"from it (image URLs must lead to public hosts); send the image inline as a data URL ({DATA_URL_EXAMPLE})",
        param=param,
        code="image_fetch_failed",
    )


async def fetch_image_bytes(
    client: httpx.AsyncClient, destinations: Destinations, url: str, limits: ImageLimits, param: str
) -> bytes:
    """The body at `url`, following at most `limits.max_redirects` http(s) redirects, each hop
    connecting only where `destinations` allows, within `limits.fetch_timeout_s` for everything
    and refused as soon as it passes `limits.max_bytes`."""
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            return await _fetch_following_redirects(client, destinations, url, limits, param)
    except (DestinationRefused, httpx.ConnectError, httpx.ConnectTimeout) as e:
        log.info("image fetch of %s refused or unreachable: %s", _shown(url), e)
        raise unreachable(url, param) from None
    except (TimeoutError, httpx.TimeoutException):
        raise RequestError(
            f"fetching {_shown(url)} took longer than the limit of {limits.fetch_timeout_s:g} s; "
            f"use a faster host or send the image as a data URL ({DATA_URL_EXAMPLE})",
            param=param,
            code="image_fetch_timeout",
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise RequestError(
            f"could not fetch {_shown(url)}: {type(e).__name__}: {str(e)[:200]}", param=param, code="image_fetch_failed"
        ) from None


async def _fetch_following_redirects(
    client: httpx.AsyncClient, destinations: Destinations, url: str, limits: ImageLimits, param: str
) -> bytes:
    # Redirects are followed here rather than by httpx so that every hop's scheme and
    # destination are checked before it is requested.
    hop = client.build_request("GET", url).url
    if not hop.host:
        raise RequestError(
            f"the image URL {_shown(url)} names no host; give a full URL such as https://example.com/picture.png",
            param=param,
            code="invalid_image_url",
        )
    location = url  # the hop as its referrer wrote it, for messages
    for _ in range(limits.max_redirects + 1):
        if hop.scheme not in ("http", "https") or not hop.host:
            raise RequestError(
                f"{_shown(url)} redirects to {_shown(location)}; only http and https redirects are followed",
                param=param,
                code="invalid_image_url",
            )
        address = await destinations.address_of(hop.raw_host.decode("ascii"), hop.port or _DEFAULT_PORTS[hop.scheme])
        response = await client.send(pinned_request(client, hop, address), stream=True)
        try:
            if not response.has_redirect_location:
                return await _read_body(response, hop, limits, param)
            location = response.headers["location"]
            hop = hop.join(location)
        finally:
            await response.aclose()
    raise RequestError(
        f"{_shown(url)} redirects more than {limits.max_redirects} times; give the image's final URL",
        param=param,
        code="image_fetch_failed",
    )


_DEFAULT_PORTS = {"http": 80, "https": 443}


def pinned_request(client: httpx.AsyncClient, url: httpx.URL, address: Address) -> httpx.Request:
    """A GET of `url` that connects to `address` (the one checked) and to nothing the name might
    resolve to later: the URL's host becomes the address, while the Host header, TLS's server name
    (SNI) and its certificate check stay the URL's host name."""
    host_header = client.build_request("GET", url).headers["Host"]
    extensions = {} if ip_literal(url.host) is not None else {"sni_hostname": url.raw_host.decode("ascii")}
    return client.build_request(
        "GET",
        url.copy_with(host=str(address)),
        headers={**FETCH_HEADERS, "Host": host_header},
        extensions=extensions,
    )


async def _read_body(response: httpx.Response, url: httpx.URL, limits: ImageLimits, param: str) -> bytes:
    if not response.is_success:
        raise RequestError(
            f"fetching {_shown(url)} answered HTTP {response.status_code} {response.reason_phrase}; "
            "give a URL that serves the image (status 200)",
            param=param,
            code="image_fetch_failed",
        )
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise _too_many_bytes(f"{_shown(url)} is {declared} bytes", limits, param)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limits.max_bytes:  # stop reading here: the rest is never downloaded
            raise _too_many_bytes(f"{_shown(url)} is more than {limits.max_bytes} bytes", limits, param)
    return bytes(body)


# -- the two entry points --------------------------------------------------------------------------


async def load_images(urls: Sequence[str], limits: ImageLimits, params: Sequence[str]) -> list[LoadedImage]:
    """The images of one request, in order. `params[i]` names the field `urls[i]` came from (e.g.
    "messages[1].content[0].image_url.url") and is the `param` of any error about it. Fetches run
    concurrently; decoding runs in worker threads so the event loop keeps serving; the first
    failure cancels the rest and is raised."""
    if len(urls) != len(params):
        raise ValueError(f"{len(urls)} image URLs but {len(params)} field names")
    if len(urls) > limits.max_images:
        raise RequestError(
            f"this request has {len(urls)} images; at most {limits.max_images} are accepted per request",
            param=params[limits.max_images],
            code="too_many_images",
        )
    client = (
        _http_client(limits) if any(_scheme(url) in ("http", "https") for url in urls) and limits.fetch_urls else None
    )
    destinations = Destinations(limits.url_policy)  # one per request: its hosts resolved once
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(_load_url(client, destinations, url, limits, param))
                for url, param in zip(urls, params)
            ]
    except ExceptionGroup as failed:
        first = next((e for e in _leaf_errors(failed) if isinstance(e, RequestError)), None)
        if first is None:
            raise
        raise first from None
    finally:
        if client is not None:
            await client.aclose()
    return [task.result() for task in tasks]


def load_image_file(path: str | os.PathLike, limits: ImageLimits, param: str = "--image") -> LoadedImage:
    """A local image file, for the CLI (`jfire generate --image PATH`), under the same limits."""
    try:
        with open(path, "rb") as file:
            data = file.read(limits.max_bytes + 1)  # a bounded read: the path may be a device or a pipe
    except OSError as e:
        raise RequestError(f"cannot read the image file {os.fspath(path)!r}: {e.strerror or e}", param=param) from None
    return decode_image(data, limits, param)


def _scheme(url: str) -> str:
    """The URL's scheme, lower case ("" when it has none); read from its head only, as a data
    URL may be megabytes long."""
    head = url[:64].lstrip()
    return head.partition(":")[0].lower() if ":" in head else ""


def _http_client(limits: ImageLimits) -> httpx.AsyncClient:
    # trust_env=False: no proxies (which would connect where the policy never looked) or .netrc
    # credentials picked up from the environment, so a request cannot make the server present
    # credentials meant for something else. No keep-alive: requests are addressed by IP, and a
    # pooled TLS connection checked for one host name must not carry a request for another.
    return httpx.AsyncClient(
        timeout=limits.fetch_timeout_s,
        follow_redirects=False,
        trust_env=False,
        limits=httpx.Limits(max_keepalive_connections=0),
    )


async def _load_url(
    client: httpx.AsyncClient | None, destinations: Destinations, url: str, limits: ImageLimits, param: str
) -> LoadedImage:
    url, scheme = url.strip(), _scheme(url)
    if scheme == "data":
        data = await asyncio.to_thread(data_url_bytes, url, limits, param)
    elif scheme in ("http", "https"):
        if not limits.fetch_urls or client is None:
            raise RequestError(
                f"fetching image URLs is turned off on this server; send the image inline as a data URL: {DATA_URL_EXAMPLE}",
                param=param,
                code="image_fetch_disabled",
            )
        data = await fetch_image_bytes(client, destinations, url, limits, param)
    else:
        accepted = "a data URL" + (" or an http(s) URL" if limits.fetch_urls else "")
        what = f"has the scheme {scheme}:" if scheme else ("is empty" if not url else "is not a URL")
        raise RequestError(
            f"the image URL {what}; give {accepted}, e.g. {DATA_URL_EXAMPLE}", param=param, code="invalid_image_url"
        )
    return await asyncio.to_thread(decode_image, data, limits, param)


def _leaf_errors(group: BaseExceptionGroup) -> list[BaseException]:
    leaves: list[BaseException] = []
    for error in group.exceptions:
        leaves.extend(_leaf_errors(error) if isinstance(error, BaseExceptionGroup) else [error])
    return leaves
