"""What lets a decode group trust a KV transfer it did not watch being made.

JAX's transfer server cannot authenticate its peers (anyone who reaches its port may pull or
publish under any id), so the deployment keeps it on a private network and checks what
travels over it at the application level, with the deployment secret (jfire.deployment_secret):

- Every transfer has a 128-bit random id (`new_transfer_id`) beside the 62-bit one JAX's
  transfer server keys its arrays by (its ids are at most 64 bits). A decode group takes each
  id once (`RecentIds`): a descriptor replayed from the wire is refused.
- The descriptor the prefill group hands the frontend (where to pull from, how many pages,
  the pages' sum) is signed, HMAC-SHA256 over all its fields (`sign_transfer`): a decode group
  refuses one that no process of this deployment made, or that was changed on the way.
- The pages' sum is keyed (`keyed_page_sums`): a multilinear hash of the pages' bits, each
  16-bit half-word times its own weight, summed mod 2**32 in two lanes. The weights are
  Threefry-2x32 (20 rounds, jax.random's function, written out here elementwise over the
  words' places, so that XLA can fuse it into the sum; jax.random's own calls materialize
  their bits) under a 64-bit key derived from the secret and the transfer's id: they differ
  per transfer, and nobody without the secret knows them. The tag is each lane's top 16 bits (after a secret offset): the top
  half of a multilinear hash mod 2**32 over 16-bit words is strongly universal (Lemire and
  Kaser, "Strongly universal string hashing is fast", 2014), so bytes changed on the way, or
  forged outright, pass with probability about 2**-32, where the plain wrapping sum let any
  swap of two words through.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import secrets
import struct
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jfire.deployment_secret import DeploymentSecret
from jfire.disagg import blocks
from jfire.errors import JfireError

ID_BYTES = 16  # 128 bits: never guessed, never repeated
TAG_LANES = 2  # each lane gives 16 bits of the 32-bit tag
MAX_ARRAYS = 64  # cache arrays per page a keyed sum tells apart (models have 1 to 4)
KV_PURPOSE = "kv"  # the page sums' key
DESCRIPTOR_PURPOSE = "kv-transfer"  # the descriptors' signatures


def new_transfer_id() -> str:
    return secrets.token_hex(ID_BYTES)


def is_transfer_id(value) -> bool:
    return isinstance(value, str) and len(value) == 2 * ID_BYTES and all(c in "0123456789abcdef" for c in value)


@dataclasses.dataclass(frozen=True)
class TransferKey:
    """One transfer's key of its keyed page sums, the same on both sides."""

    words: tuple[int, int]  # the Threefry key the weights are drawn under
    offsets: tuple[int, int]  # added to each lane's sum before its top bits are taken

    @classmethod
    def of(cls, secret: DeploymentSecret, transfer_id: str) -> TransferKey:
        w = struct.unpack("<8I", secret.sign(KV_PURPOSE, bytes.fromhex(transfer_id)))
        return cls((w[0], w[1]), (w[2], w[3]))

    def device_words(self) -> np.ndarray:
        return np.array(self.words, np.uint32)

    def tag(self, page_sums: np.ndarray) -> int:
        """The transfer's 32-bit tag from its pages' [pages, TAG_LANES] keyed sums."""
        totals = (np.asarray(page_sums, np.uint64).sum(axis=0) + np.array(self.offsets, np.uint64)) % (1 << 32)
        return int((int(totals[0]) >> 16) << 16 | int(totals[1]) >> 16)


# -- the device side ---------------------------------------------------------------------------

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x, r: int):
    return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def _threefry(k0, k1, x0, x1):
    """Threefry-2x32, 20 rounds (bit for bit jax.random's), elementwise over x0 and x1."""
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = x0 + k0, x1 + k1
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def _array_sums(x, axis: int, array: int, key):
    """[pages, TAG_LANES] uint32: each page's keyed sums over one cache array's pages (stacked
    along `axis`). A word's weights depend on its page's place in the transfer, its array and
    its place in the page only, never on how many pages the program was compiled for."""
    size = jnp.dtype(x.dtype).itemsize
    bits = jax.lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[size]).astype(jnp.uint32)
    halves = 2 if size == 4 else 1  # the 16-bit halves of a word, each weighed on its own
    shape = (*x.shape, halves)
    half = jax.lax.broadcasted_iota(jnp.uint32, shape, len(x.shape))
    words = (bits[..., None] >> (half * jnp.uint32(16))) & jnp.uint32(0xFFFF)
    element, stride = half, halves  # the half-word's place in its page
    for d in reversed(range(len(x.shape))):
        if d != axis:
            element = element + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
            stride *= x.shape[d]
    page = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    # One Threefry call per half-word: its two outputs are that half-word's weights in the two lanes.
    lane_weights = _threefry(key[0], key[1], element, page * jnp.uint32(MAX_ARRAYS) + jnp.uint32(array))
    weighted = jnp.stack([w * words for w in lane_weights], axis=-1)
    return jnp.sum(weighted, axis=tuple(d for d in range(len(shape)) if d != axis), dtype=jnp.uint32)


def keyed_page_sums(stacked: list, axes: list[int], key) -> jax.Array:
    """[pages, TAG_LANES] uint32: each page's keyed sums over every cache array (`stacked`: each
    array's pages stacked along axes[a]; `key`: TransferKey.device_words on the device). One
    reduction per array, its weights computed inside it."""
    assert len(stacked) <= MAX_ARRAYS
    return sum(_array_sums(x, axis, a, key) for a, (x, axis) in enumerate(zip(stacked, axes)))


# -- descriptors -------------------------------------------------------------------------------


def _signed_bytes(transfer: dict) -> bytes:
    return json.dumps({k: v for k, v in transfer.items() if k != "signature"}, sort_keys=True).encode()


def sign_transfer(secret: DeploymentSecret, transfer: dict) -> dict:
    """The descriptor with its signature, over every other field."""
    return {**transfer, "signature": secret.sign(DESCRIPTOR_PURPOSE, _signed_bytes(transfer)).hex()}


def signed_by_deployment(secret: DeploymentSecret, transfer: dict) -> bool:
    signature = transfer.get("signature")
    if not isinstance(signature, str) or len(signature) != 64:
        return False
    try:
        tag = bytes.fromhex(signature)
        return secret.verify(DESCRIPTOR_PURPOSE, tag, _signed_bytes(transfer))
    except (ValueError, TypeError):  # not hex, or a field JSON cannot hold
        return False


class RecentIds:
    """Transfer ids a decode group has taken, the last `keep` of them: each is taken once.
    An id older than that cannot be replayed usefully either: its prefill group released its
    pages long ago, so a pull of it finds nothing, and its keyed sum fits no other bytes."""

    def __init__(self, keep: int = 1 << 16):
        self.keep = keep
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def take(self, transfer_id: str) -> bool:
        """True the first time an id is taken, False after."""
        with self._lock:
            if transfer_id in self._ids:
                return False
            self._ids[transfer_id] = None
            while len(self._ids) > self.keep:
                self._ids.popitem(last=False)
            return True


# -- what a descriptor may say --------------------------------------------------------------

UUID_LIMIT = 1 << 62  # the transfer server's ids (kv_transfer.new_uuid, blocks.pair_uuid)


def check_fields(t: dict, layout, prefill_groups: frozenset[str]) -> None:
    """Raises JfireError unless each field of a transfer's descriptor is as a prefill group
    of this deployment makes it, for a decode group of this `layout` (kv_transfer.KVLayout).
    Nothing the engine thread reads of a transfer is left unchecked."""

    def bad(field: str, should: str) -> JfireError:
        return JfireError(f"the transfer's {field!r} must be {should}, got {str(t.get(field))[:100]!r}")

    if not is_transfer_id(t.get("id")):
        raise bad("id", "32 lowercase hex digits")
    if not (blocks.is_int(t.get("uuid")) and 0 <= t["uuid"] < UUID_LIMIT):
        raise bad("uuid", "an integer in [0, 2**62)")
    if t.get("group") not in prefill_groups:
        raise bad("group", f"one of this deployment's prefill groups ({', '.join(sorted(prefill_groups))})")
    num_pages = t.get("num_pages")
    if not (blocks.is_int(num_pages) and num_pages >= 1):
        raise bad("num_pages", "a positive count of pages")
    if not (isinstance(t.get("pages"), list) and len(t["pages"]) == num_pages and all(map(blocks.is_int, t["pages"]))):
        raise bad("pages", f"the {num_pages} page ids it was sent from")
    for field in ("bytes", "raw_bytes"):
        if not (blocks.is_int(t.get(field)) and t[field] >= 0):
            raise bad(field, "a count of bytes")
    if not (blocks.is_int(t.get("checksum")) and 0 <= t["checksum"] < 1 << 32):
        raise bad("checksum", "a 32-bit unsigned integer")
    protocol = t.get("protocol")
    if protocol is None:
        if not is_address(t.get("address")):
            raise bad("address", "the prefill group's transfer server, host:port")
        shards = t.get("shards")
        if not (blocks.is_int(shards) and shards >= 1 and layout.usable_shards(shards) == shards):
            raise bad(
                "shards",
                f"a split of the heads this group can take: 1 or {layout.preferred_shards()} "
                f"(its {len(layout.devices())} device(s), {layout.wire_heads} KV heads)",
            )
    elif protocol == "blocks":
        blocks.check_description(t.get("sender"), "the transfer's 'sender'")
        try:
            plan = blocks.BlockPlan(layout, t["sender"], blocks.describe(layout))
        except Exception as e:  # noqa: BLE001 - a layout the cache's shapes cannot be cut by
            raise bad("sender", f"a layout of this model's KV cache ({type(e).__name__}: {e})") from None
        addresses = t.get("addresses")
        senders = {str(p) for p, _ in plan.pairs()}
        if not (isinstance(addresses, dict) and all(is_address(addresses.get(p)) for p in senders)):
            raise bad("addresses", f"the transfer servers (host:port) of sending processes {sorted(senders)}")
    else:
        raise bad("protocol", "absent (one process a side) or 'blocks'")


def is_address(x) -> bool:
    """Whether x is host:port (a transfer server's address as JAX gives it)."""
    if not isinstance(x, str) or len(x) > 300:
        return False
    host, _, port = x.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
