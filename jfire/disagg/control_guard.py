"""What a group's control server (jfire.disagg.worker) lets in: who may call it, how large a
request may be, and what each route's body must hold.

- Every route but GET /health needs the deployment's control token, `Authorization: Bearer
  <DeploymentSecret.bearer()>`, compared in constant time: without it, 401 before the body is
  read or anything is done. /health answers its status only, for probes: nothing about
  addresses, processes or requests.
- A POST must declare its body's length (411 otherwise), and one longer than its route's
  bound gets 413 before any of it is read.
- The bodies (`prefill_request`, `decode_request`, `cancel_request`, `blocks_request`) are
  checked field by field before the engine sees them: a bad one is a BadRequest (400), and
  the engine is untouched. The decode group's connector checks the KV transfer's descriptor
  (jfire.disagg.connectors.DecodeConnector.check), since only it knows its cache's layout.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import math

from fastapi import Request
from fastapi.responses import JSONResponse

from jfire.deployment_secret import DeploymentSecret
from jfire.disagg import blocks
from jfire.errors import JfireError
from jfire.sampling import MAX_TOP_LOGPROBS, SamplingParams
from jfire.vision.encoder import RequestImage

# A body's bound. /prefill carries the prompt's images, encoded for the model already: float32
# pixels in base64. The largest legitimate one: 8 images (ImageLimits.max_images) of Kimi K2.5's
# largest input, about 3.2 MP x 3 channels x 4 bytes = 38 MB, 4/3 of that in base64: 410 MB.
MAX_PREFILL_BODY_BYTES = 512 << 20
# Every other route: a whole context's prompt ids as JSON (8 MB for a million tokens), and
# a descriptor's page ids or a context's block hashes, with room to spare.
MAX_BODY_BYTES = 64 << 20
MAX_ID_CHARS = 256  # a request id: the frontend's are short
MAX_SHARDS = 1024  # a split of the KV heads on the wire, far above any device count
MAX_IMAGES = 256  # a prompt's images (the frontend's own limit is lower: ImageLimits.max_images)
MAX_HASHES = 1 << 20  # block hashes in one /kv/blocks (a context's blocks)


class BadRequest(JfireError):
    """A body the control server refuses with 400: it says which field, and what it must be."""


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def body_limit(path: str) -> int:
    return MAX_PREFILL_BODY_BYTES if path == "/prefill" else MAX_BODY_BYTES


class ControlGuard:
    """ASGI middleware: the control token and the body bounds, before any route runs."""

    def __init__(self, app, secret: DeploymentSecret):
        self.app, self.secret = app, secret

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> JSONResponse | None:
        if scope["path"] == "/health" and scope["method"] in ("GET", "HEAD"):
            return None
        if not self.secret.check_bearer(_header(scope, b"authorization")):
            return error(
                401,
                "missing or wrong deployment token: a group's control routes answer only 'Authorization: Bearer "
                "<token>' with the token of this deployment's secret (the frontend sends it)",
            )
        if scope["method"] == "POST":
            length, limit = _header(scope, b"content-length"), body_limit(scope["path"])
            if length is None or not length.isdigit():
                return error(411, "send the request body with a Content-Length header")
            if int(length) > limit:
                return error(413, f"the request body has {length} bytes; {scope['path']} takes at most {limit}")
        return None


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def json_object(request: Request) -> dict:
    """The request's body, which must be one JSON object."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


# -- the fields ----------------------------------------------------------------------------------


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _shown(value) -> str:
    return repr(value)[:100]


def _only(body: dict, required: set[str], optional: set[str], route: str) -> None:
    missing, unknown = required - set(body), set(body) - required - optional
    if missing:
        raise BadRequest(f"{route} needs {', '.join(sorted(missing))}")
    if unknown:
        raise BadRequest(
            f"{route} takes no {', '.join(sorted(unknown))} (it takes {', '.join(sorted(required | optional))})"
        )


def request_id(body: dict) -> str:
    value = body.get("request_id")
    if not (isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS):
        raise BadRequest(f"'request_id' must be a string of 1 to {MAX_ID_CHARS} characters, got {_shown(value)}")
    return value


def prompt_ids(body: dict) -> list[int]:
    value = body.get("prompt_ids")
    if not (isinstance(value, list) and value and all(blocks.is_int(i) and 0 <= i < 1 << 31 for i in value)):
        raise BadRequest("'prompt_ids' must be a non-empty list of token ids (integers >= 0)")
    return value


def _fits(annotation: str, value) -> bool:
    """Whether a JSON value fits a SamplingParams field's annotation (an unknown one is left to
    SamplingParams' own checks)."""
    options = [a.strip() for a in annotation.split("|")]
    if value is None:
        return "None" in options
    return any(_fits_one(option, value) for option in options if option != "None")


def _fits_one(kind: str, value) -> bool:
    if kind == "float":
        return _is_number(value) and math.isfinite(value)
    if kind == "int":
        return blocks.is_int(value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind.startswith("tuple[") and kind.endswith(", ...]"):
        return isinstance(value, list) and all(_fits_one(kind[6:-6], x) for x in value)
    return True


_SAMPLING_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(SamplingParams)}


def sampling(body: dict) -> SamplingParams:
    value = body.get("sampling")
    if not isinstance(value, dict):
        raise BadRequest(f"'sampling' must be an object of sampling parameters, got {_shown(value)}")
    for name, field_value in value.items():
        if name not in _SAMPLING_FIELDS:
            raise BadRequest(f"'sampling' has no parameter {name!r}")
        if not _fits(_SAMPLING_FIELDS[name], field_value):
            raise BadRequest(f"'sampling.{name}' must be {_SAMPLING_FIELDS[name]}, got {_shown(field_value)}")
    return SamplingParams.from_json(value)  # its own range checks raise RequestError (400)


def _images(body: dict) -> list[RequestImage]:
    value = body.get("images") or []
    if not (isinstance(value, list) and len(value) <= MAX_IMAGES):
        raise BadRequest(f"'images' must be a list of at most {MAX_IMAGES} encoded images")
    images = []
    for i, image in enumerate(value):
        where = f"'images[{i}]'"
        if not isinstance(image, dict) or set(image) != {"hash", "shape", "pixels", "grid", "num_tokens"}:
            raise BadRequest(f"{where} must be an object of hash, shape, pixels, grid and num_tokens")
        shape, grid = image["shape"], image["grid"]
        if not (isinstance(shape, list) and 0 < len(shape) <= 4 and all(blocks.is_int(n) and n >= 1 for n in shape)):
            raise BadRequest(f"{where}: shape must be 1 to 4 positive sizes")
        if not (isinstance(grid, list) and len(grid) <= 4 and all(blocks.is_int(n) and n >= 1 for n in grid)):
            raise BadRequest(f"{where}: grid must be at most 4 positive sizes")
        if not (blocks.is_int(image["num_tokens"]) and image["num_tokens"] >= 1):
            raise BadRequest(f"{where}: num_tokens must be a positive count")
        if not (isinstance(image["hash"], str) and len(image["hash"]) == 64 and isinstance(image["pixels"], str)):
            raise BadRequest(f"{where}: hash must be 64 hex digits and pixels base64 text")
        try:
            images.append(RequestImage.from_json(image))
        except (ValueError, binascii.Error) as e:
            raise BadRequest(f"{where}: {e}") from None
    return images


@dataclasses.dataclass(frozen=True)
class PrefixSource:
    """Another prefill group to fetch the prompt's blocks [first, blocks) from."""

    group: str
    first: int
    blocks: int


def _prefix_from(body: dict, prefill_groups: frozenset[str], own_group: str) -> PrefixSource | None:
    value = body.get("prefix_from")
    if value is None:
        return None
    others = sorted(prefill_groups - {own_group})
    if not isinstance(value, dict) or set(value) != {"group", "first", "blocks"}:
        raise BadRequest("'prefix_from' must be {'group': another prefill group's name, 'first': n, 'blocks': n}")
    if value["group"] not in others:
        raise BadRequest(
            f"'prefix_from' names group {_shown(value['group'])}, which is not another prefill group of this "
            f"deployment ({', '.join(others) or 'it has no other'})"
        )
    first, count = value["first"], value["blocks"]
    if not (blocks.is_int(first) and blocks.is_int(count) and 0 <= first < count):
        raise BadRequest(f"'prefix_from' blocks must be 0 <= first < blocks, got {_shown(first)}, {_shown(count)}")
    return PrefixSource(value["group"], first, count)


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    shards: int  # the KV heads' split the decode group asked for (the prefill group may send fewer)
    receiver: dict | None  # the decode group's layout, when a group spans processes (jfire.disagg.blocks)
    prefix_from: PrefixSource | None
    images: list[RequestImage]


def prefill_request(body: dict, prefill_groups: frozenset[str], own_group: str) -> PrefillRequest:
    _only(body, {"request_id", "prompt_ids", "sampling"}, {"shards", "receiver", "prefix_from", "images"}, "/prefill")
    shards = body.get("shards", 1)
    if not (blocks.is_int(shards) and 1 <= shards <= MAX_SHARDS):
        raise BadRequest(f"'shards' must be a count of KV head pieces, 1 to {MAX_SHARDS}, got {_shown(shards)}")
    receiver = body.get("receiver")
    if receiver is not None:
        blocks.check_description(receiver, "'receiver'")
    return PrefillRequest(
        request_id(body),
        prompt_ids(body),
        sampling(body),
        shards,
        receiver,
        _prefix_from(body, prefill_groups, own_group),
        _images(body),
    )


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    first_token: int
    first_logprobs: list | None
    transfer: dict  # checked by the decode connector (it knows its layout)


def _logprobs_entry(value, vocab_size: int) -> list | None:
    """One token's logprobs as the engine writes them: [logprob, [[id, logprob], ...]]."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == 2 and _is_number(value[0]) and isinstance(value[1], list)
    ok = ok and len(value[1]) <= MAX_TOP_LOGPROBS + 1
    ok = ok and all(
        isinstance(p, list) and len(p) == 2 and blocks.is_int(p[0]) and 0 <= p[0] < vocab_size and _is_number(p[1])
        for p in value[1]
    )
    if not ok:
        raise BadRequest("'first_logprobs' must be null or [logprob, [[token id, logprob], ...]] as a prefill made it")
    return value


def decode_request(body: dict, vocab_size: int) -> DecodeRequest:
    _only(body, {"request_id", "prompt_ids", "sampling", "first_token", "transfer"}, {"first_logprobs"}, "/decode")
    first_token = body["first_token"]
    if not (blocks.is_int(first_token) and 0 <= first_token < vocab_size):
        raise BadRequest(f"'first_token' must be a token id in [0, {vocab_size}), got {_shown(first_token)}")
    if not isinstance(body["transfer"], dict):
        raise BadRequest("'transfer' must be the object a prefill group answered")
    return DecodeRequest(
        request_id(body),
        prompt_ids(body),
        sampling(body),
        first_token,
        _logprobs_entry(body.get("first_logprobs"), vocab_size),
        body["transfer"],
    )


def cancel_request(body: dict) -> str:
    _only(body, {"request_id"}, set(), "/cancel")
    return request_id(body)


def blocks_request(body: dict) -> tuple[list[bytes], bytes]:
    """(block hashes, model identity) of a /kv/blocks."""
    _only(body, {"hashes", "identity"}, set(), "/kv/blocks")
    hashes, identity = body["hashes"], body["identity"]
    try:
        if not (isinstance(hashes, list) and len(hashes) <= MAX_HASHES and isinstance(identity, str)):
            raise TypeError
        parsed = [bytes.fromhex(h) for h in hashes if isinstance(h, str) and len(h) <= 128]
        if len(parsed) != len(hashes) or len(identity) > 256:
            raise TypeError
        return parsed, bytes.fromhex(identity)
    except (TypeError, ValueError):
        raise BadRequest(f"expected {{'hashes': [at most {MAX_HASHES} hex block hashes], 'identity': hex}}") from None
