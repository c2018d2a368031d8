"""jfire.vision.images against independent references: decoded pixels equal transformers'
`convert_to_rgb` of Pillow's own decode of the same bytes (what the HF image processors get from
a PIL input); the same picture by data URL, by http URL (a local server) and by file gives equal
pixels and hashes; each bad input is a RequestError naming the field, with a message that says
what is wrong and what would be right, and never a hang (fetch limits are short here).

The local server is on 127.0.0.1, which image fetches refuse by default: these tests fetch with
private addresses allowed (`LOCAL`); tests/vision/test_image_url_policy.py tests the refusals."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import threading
import time
import urllib.parse
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from jfire.errors import JfireError, RequestError
from jfire.vision.images import ImageLimits, LoadedImage, decode_image, load_image_file, load_images
from jfire.vision.url_policy import UrlPolicy

PARAM = "messages[1].content[0].image_url.url"
LOCAL = UrlPolicy(allow_private=True)  # the test server is on 127.0.0.1
LIMITS = ImageLimits(url_policy=LOCAL)
SHORT = ImageLimits(fetch_timeout_s=0.5, url_policy=LOCAL)
HUGE_BODY = 256 * 2**20  # what /huge would send if nobody stopped reading


# -- pictures ----------------------------------------------------------------------------------------


def photo(seed: int, width: int = 48, height: int = 32) -> np.ndarray:
    """uint8 [H, W, 3]: gradients plus noise, so that lossy codecs have something to do."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def rgba_picture() -> Image.Image:
    rgba = np.concatenate([photo(1), np.zeros((32, 48, 1), np.uint8)], axis=-1)
    rgba[..., 3] = np.arange(48, dtype=np.uint8)[None, :] * 5  # 0 (fully transparent) .. 235
    return Image.fromarray(rgba, "RGBA")


def palette_with_transparency() -> bytes:
    image = Image.fromarray(photo(2)).quantize(16)
    return encoded(image, "PNG", transparency=3)


def animated_gif() -> bytes:
    first, second = Image.fromarray(photo(3)), Image.fromarray(photo(4)[::-1].copy())
    return encoded(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)


def jpeg_rotated_by_exif() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    return encoded(Image.fromarray(photo(5)), "JPEG", quality=90, exif=exif)


def mpo() -> bytes:
    """A multi-picture JPEG, as phones write (the second picture a depth map or the like)."""
    first, second = Image.fromarray(photo(6)), Image.fromarray(photo(7))
    return encoded(first, "MPO", save_all=True, append_images=[second])


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG header for a picture of this size, followed by a few bytes of pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


RGB = Image.fromarray(photo(0))
PNG = encoded(RGB, "PNG")
PICTURES = {  # name: (bytes, the media type a client would declare)
    "png": (PNG, "image/png"),
    "jpeg": (encoded(RGB, "JPEG", quality=85), "image/jpeg"),
    "webp": (encoded(RGB, "WEBP", quality=80), "image/webp"),
    "webp-lossless": (encoded(RGB, "WEBP", lossless=True), "image/webp"),
    "gif-animated": (animated_gif(), "image/gif"),
    "rgba-png": (encoded(rgba_picture(), "PNG"), "image/png"),
    "greyscale-png": (encoded(RGB.convert("L"), "PNG"), "image/png"),
    "greyscale-alpha-png": (encoded(rgba_picture().convert("LA"), "PNG"), "image/png"),
    "palette-png": (encoded(RGB.quantize(32), "PNG"), "image/png"),
    "palette-transparent-png": (palette_with_transparency(), "image/png"),
    "jpeg-exif-rotated": (jpeg_rotated_by_exif(), "image/jpeg"),
    "mpo": (mpo(), "image/jpeg"),
}


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def reference_pixels(data: bytes) -> np.ndarray:
    """What an HF image processor receives for `Image.open(BytesIO(data))`."""
    return convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)


# -- a local HTTP server -----------------------------------------------------------------------------


class ServerState:
    def __init__(self):
        self.files: dict[str, bytes] = {"png": PNG, "webp-lossless": PICTURES["webp-lossless"][0]}
        self.huge_sent = 0
        self.huge_done = threading.Event()
        self.requests: list[tuple[str, str | None]] = []  # (path, Host header) of each GET


def handler_for(state: ServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output clean
            pass

        def send_body(self, body: bytes, status: int = 200):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def redirect(self, location: str):
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            state.requests.append((self.path, self.headers.get("Host")))
            try:
                self.route()
            except OSError:  # the client gave up first (the tests of limits make it)
                pass

        def route(self):
            parts = self.path.strip("/").split("/")
            if parts[0] == "img" and parts[1] in state.files:
                self.send_body(state.files[parts[1]])
            elif parts[0] == "redirect":  # /redirect/N/name: N hops, then /img/name
                hops = int(parts[1])
                self.redirect(f"/redirect/{hops - 1}/{parts[2]}" if hops > 1 else f"/img/{parts[2]}")
            elif parts[0] == "to-file":
                self.redirect("file:///etc/hostname")
            elif parts[0] == "to":  # /to/<a URL, percent-encoded>: a redirect there
                self.redirect(urllib.parse.unquote(parts[1]))
            elif parts[0] == "sleep":  # no answer within a short limit
                time.sleep(2)
                self.send_body(PNG)
            elif parts[0] == "drip":  # answers at once, then a byte at a time: a read timeout never fires
                self.send_response(200)
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.dribble(PNG)
            elif parts[0] == "huge":
                self.send_huge()
            elif parts[0] == "huge-declared":
                self.send_response(200)
                self.send_header("Content-Length", str(10**9))
                self.end_headers()
            else:
                self.send_body(b"not here", status=404)

        def dribble(self, body: bytes):
            for i in range(min(len(body), 40)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(0.05)

        def send_huge(self):
            """No Content-Length (the body ends when the connection closes), counting what it sends."""
            self.send_response(200)
            self.end_headers()
            chunk = PNG[:64] + b"\0" * (2**16 - 64)
            try:
                while state.huge_sent < HUGE_BODY:
                    self.wfile.write(chunk)
                    state.huge_sent += len(chunk)
            except OSError:  # the client hung up
                pass
            finally:
                state.huge_done.set()

    return Handler


@pytest.fixture(scope="module")
def server():
    state = ServerState()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


# -- helpers -----------------------------------------------------------------------------------------


def load(url: str, limits: ImageLimits = LIMITS) -> LoadedImage:
    return asyncio.run(load_images([url], limits, [PARAM]))[0]


def refusal(url: str, limits: ImageLimits = LIMITS, *phrases: str) -> RequestError:
    """The RequestError loading `url` raises: about PARAM, its message holding every phrase."""
    with pytest.raises(RequestError) as caught:
        load(url, limits)
    error = caught.value
    assert error.param == PARAM
    for phrase in phrases:
        assert phrase in str(error), f"{phrase!r} not in {str(error)!r}"
    return error


# -- decoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PICTURES))
def test_decoded_pixels_equal_what_hf_processors_receive(name):
    data, media_type = PICTURES[name]
    loaded = load(data_url(data, media_type))
    assert loaded.image.mode == "RGB" and loaded.image.info.get("transparency") is None
    assert loaded.pixels.dtype == np.uint8
    np.testing.assert_array_equal(loaded.pixels, reference_pixels(data))
    assert loaded.size == Image.open(io.BytesIO(data)).size


def test_animated_gif_gives_its_first_frame():
    gif = Image.open(io.BytesIO(PICTURES["gif-animated"][0]))
    gif.seek(1)
    second = convert_to_rgb(gif, return_numpy=True)
    loaded = load(data_url(PICTURES["gif-animated"][0], "image/gif"))
    assert loaded.source_format == "GIF"
    assert not np.array_equal(loaded.pixels, second)


def test_transparency_is_composited_onto_white():
    loaded = load(data_url(PICTURES["rgba-png"][0]))
    assert (loaded.pixels[:, 0] == 255).all()  # alpha 0: white
    assert not np.array_equal(loaded.pixels, np.asarray(rgba_picture().convert("RGB")))  # not just dropped


def test_exif_orientation_is_not_applied():
    loaded = load(data_url(PICTURES["jpeg-exif-rotated"][0], "image/jpeg"))
    assert loaded.size == (48, 32)  # as stored, not turned to 32 x 48


def test_mpo_decodes_as_its_first_picture():
    assert load(data_url(PICTURES["mpo"][0], "image/jpeg")).source_format == "MPO"


def test_data_url_http_url_and_file_give_equal_pixels_and_hashes(server, tmp_path):
    base, _ = server
    by_data = load(data_url(PNG))
    by_http = load(f"{base}/img/png")
    path = tmp_path / "picture.png"
    path.write_bytes(PNG)
    by_file = load_image_file(path, LIMITS)
    for other in (by_http, by_file):
        np.testing.assert_array_equal(other.pixels, by_data.pixels)
        assert other.content_hash == by_data.content_hash
    assert len(by_data.content_hash) == 32
    # The hash is over pixels, not bytes: the same picture in another lossless format hits.
    assert load(f"{base}/img/webp-lossless").content_hash == by_data.content_hash


def test_a_different_picture_of_the_same_size_hashes_differently():
    other = encoded(Image.fromarray(photo(99)), "PNG")
    assert load(data_url(other)).size == load(data_url(PNG)).size
    assert load(data_url(other)).content_hash != load(data_url(PNG)).content_hash


def test_several_images_load_concurrently_in_order(server):
    base, _ = server
    urls = [f"{base}/img/png", data_url(PICTURES["jpeg"][0], "image/jpeg"), f"{base}/redirect/2/png"]
    params = [f"messages[{i}].content[0].image_url.url" for i in range(3)]
    loaded = asyncio.run(load_images(urls, LIMITS, params))
    np.testing.assert_array_equal(loaded[1].pixels, reference_pixels(PICTURES["jpeg"][0]))
    assert loaded[0].content_hash == loaded[2].content_hash != loaded[1].content_hash
    assert asyncio.run(load_images([], LIMITS, [])) == []


def test_data_url_leniencies():
    """What clients commonly send besides the canonical form: missing padding, line breaks,
    percent-escapes, a mislabelled media type, image/jpg."""
    encoded_png = base64.b64encode(PNG).decode()
    expected = load(data_url(PNG)).content_hash
    for url in (
        "data:image/png;base64," + encoded_png.rstrip("="),
        "data:image/png;base64," + "\n".join(encoded_png[i : i + 76] for i in range(0, len(encoded_png), 76)),
        "data:image/png;base64," + encoded_png.replace("+", "%2B").replace("/", "%2F"),
        "data:image/jpeg;base64," + encoded_png,
        "DATA:IMAGE/JPG;BASE64," + encoded_png,
    ):
        assert load(url).content_hash == expected


def test_redirects_are_followed_a_few_times(server):
    base, _ = server
    assert load(f"{base}/redirect/5/png").content_hash == load(data_url(PNG)).content_hash
    refusal(f"{base}/redirect/6/png", LIMITS, "redirects more than 5 times")
    refusal(f"{base}/to-file", LIMITS, "redirects to file://", "only http and https")


# -- bad input ---------------------------------------------------------------------------------------


def test_corrupt_bytes():
    refusal(
        data_url(b"this is not an image at all"),
        LIMITS,
        "not an image in an accepted format",
        "PNG, JPEG, WebP and GIF",
    )
    corrupt_png = bytearray(PNG)
    corrupt_png[len(PNG) // 2] ^= 0xFF
    refusal(data_url(bytes(corrupt_png)), LIMITS, "the PNG could not be decoded", "corrupt or truncated")


def test_truncated_png():
    refusal(data_url(PNG[: len(PNG) // 2]), LIMITS, "the PNG could not be decoded", "truncated", "send the whole file")
    refusal(data_url(PNG[:20]), LIMITS, "the PNG could not be decoded", "truncated")
    refusal(data_url(PNG[:8] + b"\0" * 40), LIMITS, "starts like a PNG file but its header is corrupt or truncated")
    refusal("data:image/png;base64,", LIMITS, "empty")


@pytest.mark.parametrize(("fmt", "name"), [("BMP", "BMP"), ("TIFF", "TIFF"), ("ICO", "ICO")])
def test_unsupported_format_is_named(fmt, name):
    data = encoded(RGB, fmt)
    assert Image.open(io.BytesIO(data)).format == fmt  # Pillow itself could read it
    refusal(data_url(data), LIMITS, f"the image is {name}", "accepted formats are PNG, JPEG, WebP and GIF")


@pytest.mark.parametrize(
    ("data", "name"),
    [(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "SVG"), (b"\0\0\0\x18ftypheic\0\0\0\0mif1heic", "HEIC")],
)
def test_formats_pillow_cannot_read_are_named_too(data, name):
    refusal(data_url(data), LIMITS, f"the image is {name}", "PNG, JPEG, WebP and GIF")


def test_unsupported_data_url_media_type():
    refusal(data_url(PNG, "image/bmp"), LIMITS, "'image/bmp'", "image/png, image/jpeg, image/webp and image/gif")


def test_body_over_the_byte_limit_stops_reading(server):
    base, state = server
    small = ImageLimits(max_bytes=2**20, url_policy=LOCAL)
    refusal(f"{base}/huge", small, "more than 1048576 bytes", "1 MiB")
    assert state.huge_done.wait(5), "the server is still sending: the client did not hang up"
    assert state.huge_sent < 32 * 2**20  # about the limit plus the sockets' buffers, not 256 MiB


def test_declared_length_over_the_byte_limit(server):
    base, _ = server
    start = time.monotonic()
    refusal(f"{base}/huge-declared", LIMITS, "is 1000000000 bytes", "20 MiB", "smaller or more compressed")
    assert time.monotonic() - start < 2


def test_data_url_over_the_byte_limit():
    limit = len(PNG) - 100
    refusal(data_url(PNG), ImageLimits(max_bytes=limit), "the data URL holds", f"the limit is {limit} bytes per")
    # Padded out with escaped spaces: refused by its length before it is unescaped.
    exact = ImageLimits(max_bytes=len(PNG))
    assert load(data_url(PNG) + "%20" * 10, exact).content_hash == load(data_url(PNG)).content_hash
    refusal(data_url(PNG) + "%20" * 2 * len(PNG), exact, "characters long", f"the limit is {len(PNG)} bytes")


def test_too_many_pixels_is_refused_before_decoding(tmp_path):
    refusal(data_url(png_declaring(8000, 8000)), LIMITS, "8000x8000 = 64000000 pixels", "50 megapixels", "downscale")
    # Beyond Pillow's own bomb threshold Image.open refuses first; still our error.
    refusal(data_url(png_declaring(100_000, 100_000)), LIMITS, "the limit is 50000000 pixels")
    refusal(data_url(PNG), ImageLimits(max_pixels=1000), "48x32 = 1536 pixels", "the limit is 1000 pixels")
    path = tmp_path / "big.png"
    path.write_bytes(png_declaring(8000, 8000))
    with pytest.raises(RequestError) as caught:
        load_image_file(path, LIMITS)
    assert caught.value.param == "--image" and "8000x8000" in str(caught.value)


def test_too_many_images_names_the_first_one_over():
    urls = [data_url(PNG)] * 3
    params = [f"messages[0].content[{i}].image_url.url" for i in range(3)]
    with pytest.raises(RequestError) as caught:
        asyncio.run(load_images(urls, ImageLimits(max_images=2), params))
    assert caught.value.param == "messages[0].content[2].image_url.url"
    assert "this request has 3 images; at most 2 are accepted per request" in str(caught.value)


def test_one_bad_image_among_several_names_its_own_field(server):
    base, _ = server
    urls = [data_url(PNG), f"{base}/missing", data_url(PNG)]
    params = [f"messages[0].content[{i}].image_url.url" for i in range(3)]
    with pytest.raises(RequestError) as caught:
        asyncio.run(load_images(urls, LIMITS, params))
    assert caught.value.param == "messages[0].content[1].image_url.url"


def test_http_error_status_is_named(server):
    base, _ = server
    refusal(f"{base}/missing", LIMITS, "HTTP 404 Not Found", f"{base}/missing")


def test_unreachable_host():
    """Answered as a refused destination is (tests/vision/test_image_url_policy.py), so that a
    client cannot tell a closed port from an address the server may not reach."""
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    refusal(f"http://127.0.0.1:{port}/x.png", LIMITS, "could not fetch the image at", "data URL")


@pytest.mark.parametrize("path", ["sleep", "drip"])
def test_fetch_time_limit_covers_the_whole_fetch(server, path):
    base, _ = server
    start = time.monotonic()
    refusal(f"{base}/{path}", SHORT, "took longer than the limit of 0.5 s")
    assert time.monotonic() - start < 1.5


def test_fetching_off(server):
    base, _ = server
    off = ImageLimits(fetch_urls=False)
    refusal(f"{base}/img/png", off, "fetching image URLs is turned off", "data URL", "data:image/png;base64,")
    assert load(data_url(PNG), off).size == (48, 32)


@pytest.mark.parametrize("url", ["file:///etc/hostname", "ftp://127.0.0.1/x.png", "/etc/hostname", ""])
def test_other_schemes_are_refused(url):
    refusal(url, LIMITS, "give a data URL or an http(s) URL")


@pytest.mark.parametrize("url", ["http://", "http:/picture.png", "https:///picture.png"])
def test_http_url_without_a_host(url):
    refusal(url, LIMITS, "names no host", "https://example.com/picture.png")


def test_malformed_data_urls():
    refusal("data:image/png;base64" + base64.b64encode(PNG).decode(), LIMITS, "malformed data URL", "no comma")
    refusal("data:image/png," + base64.b64encode(PNG).decode(), LIMITS, "only base64 data URLs")
    refusal("data:;base64," + base64.b64encode(PNG).decode(), LIMITS, "no media type")


def test_bad_base64():
    refusal("data:image/png;base64,iVBOR!!w0KGgo=", LIMITS, "not valid base64")
    refusal("data:image/png;base64,iVBORw0KG", LIMITS, "not valid base64")  # 9 characters: no padding fixes it


def test_local_file_errors(tmp_path):
    with pytest.raises(RequestError) as caught:
        load_image_file(tmp_path / "absent.png", LIMITS)
    assert caught.value.param == "--image" and "cannot read the image file" in str(caught.value)
    path = tmp_path / "big.png"
    path.write_bytes(PNG)
    with pytest.raises(RequestError, match="the limit is 100 bytes"):
        load_image_file(path, ImageLimits(max_bytes=100))


def test_decode_image_is_usable_on_its_own():
    assert decode_image(PNG, LIMITS, "x").content_hash == load(data_url(PNG)).content_hash


def test_limits_are_checked():
    with pytest.raises(JfireError, match="max_pixels must be positive"):
        ImageLimits(max_pixels=0)
    with pytest.raises(JfireError, match="max_redirects"):
        ImageLimits(max_redirects=-1)
