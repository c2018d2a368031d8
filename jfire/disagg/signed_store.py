"""The cluster's key-value store, with every value jfire writes signed and every value it reads
checked.

jax.distributed's coordinator authenticates nobody: whoever reaches its port may set, read and
delete any key. So each value carries an HMAC-SHA256 tag under the deployment secret's "store"
key, over the key's name and the value (a value moved to another key does not verify there),
and a read whose tag is missing or wrong raises JfireError naming the key: nothing an outsider
wrote is ever parsed, let alone run. The store is not encrypted: whoever reaches the port can
still read what is in it (docs/security.md says which network that must stay on).

`SignedStore` has the method names of jax's client, so the code that uses the store (the
lock-step channel, connectors, frontend, groups) is the same whichever it is handed.

Counters (`key_value_increment`: signs of life, incarnation counts) are the coordinator's own
arithmetic and cannot carry a tag; they are read with `read_counter`, which accepts only a
plain count. What a stranger could do with one is bounded by what jfire reads it for: bump a
peer's beat (it looks alive until the next collective or JAX's own heartbeat says otherwise),
or bump a group's incarnation count (its processes then wait for each other and time out).
Neither runs code or forges data.
"""

from __future__ import annotations

from jfire.deployment_secret import DeploymentSecret
from jfire.errors import JfireError

PURPOSE = "store"
TAG_CHARS = 64  # an HMAC-SHA256 tag in hex, in front of the value
MAX_COUNTER_DIGITS = 19  # what fits an int64, the coordinator's counters


def normalize(key: str) -> str:
    """The key as the coordinator stores it ("/a//b/" -> "a/b"): what is signed is what a
    directory listing gives back."""
    return "/".join(part for part in key.split("/") if part)


class SignedStore:
    """jax.distributed's store client (`client`), every value tagged with `secret`."""

    def __init__(self, client, secret: DeploymentSecret):
        self.client = client
        self._secret = secret

    def __repr__(self) -> str:
        return "SignedStore(<jax.distributed client>)"

    # -- tags ----------------------------------------------------------------------------------

    def _tag(self, key: str, value: bytes) -> bytes:
        return self._secret.sign(PURPOSE, normalize(key).encode(), value).hex().encode()

    def _wrap(self, key: str, value: bytes) -> bytes:
        return self._tag(key, value) + value

    def _unwrap(self, key: str, stored: bytes) -> bytes:
        tag, value = stored[:TAG_CHARS], stored[TAG_CHARS:]
        try:
            ok = len(tag) == TAG_CHARS and self._secret.verify(
                PURPOSE, bytes.fromhex(tag.decode("ascii")), normalize(key).encode(), value
            )
        except (UnicodeDecodeError, ValueError):
            ok = False
        if not ok:
            raise JfireError(
                f"the cluster store's value under {normalize(key)!r} is not signed with this deployment's "
                "secret: refused (a process outside the deployment wrote it, or one started with another secret)"
            )
        return value

    @staticmethod
    def _text(key: str, value: bytes) -> str:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise JfireError(f"the cluster store's value under {normalize(key)!r} is not text") from None

    # -- the client's methods ------------------------------------------------------------------

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.client.key_value_set_bytes(key, self._wrap(key, value.encode("utf-8")), allow_overwrite=allow_overwrite)

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        self.client.key_value_set_bytes(key, self._wrap(key, bytes(value)), allow_overwrite=allow_overwrite)

    def key_value_try_get(self, key: str) -> str:
        return self._text(key, self.key_value_try_get_bytes(key))

    def key_value_try_get_bytes(self, key: str) -> bytes:
        return self._unwrap(key, self.client.key_value_try_get_bytes(key))

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self._text(key, self.blocking_key_value_get_bytes(key, timeout_in_ms))

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        return self._unwrap(key, self.client.blocking_key_value_get_bytes(key, timeout_in_ms))

    def key_value_dir_get(self, directory: str, refused: list[str] | None = None) -> list[tuple[str, str]]:
        """Every (key, value) under directory. A value that does not verify raises JfireError,
        or with `refused` given is left out and its key appended there (a reader that must not
        fail over one stranger's key: the engine thread's polls)."""
        out = []
        for key, value in self.key_value_dir_get_bytes(directory, refused):
            try:
                out.append((key, self._text(key, value)))
            except JfireError:
                if refused is None:
                    raise
                refused.append(key)
        return out

    def key_value_dir_get_bytes(self, directory: str, refused: list[str] | None = None) -> list[tuple[str, bytes]]:
        out = []
        for key, stored in self.client.key_value_dir_get_bytes(directory):
            try:
                out.append((key, self._unwrap(key, stored)))
            except JfireError:
                if refused is None:
                    raise
                refused.append(key)
        return out

    def key_value_delete(self, key: str) -> None:
        self.client.key_value_delete(key)

    def key_value_increment(self, key: str, increment: int) -> int:
        return self.client.key_value_increment(key, increment)

    def read_counter(self, key: str) -> int | None:
        """A counter's count (see the module's note: counters carry no tag), or None when it
        is not set or holds anything but a plain count."""
        try:
            text = self.client.key_value_try_get_bytes(key)
        except Exception:  # noqa: BLE001 - NotFound comes as a plain runtime error
            return None
        if not (0 < len(text) <= MAX_COUNTER_DIGITS and text.isdigit()):
            return None
        return int(text)

    def foreign_keys(self, directory: str) -> list[str]:
        """The keys under directory that others than jfire write (JAX's own gloo rendezvous),
        by name only: their values are not jfire's to read."""
        return [key for key, _ in self.client.key_value_dir_get_bytes(directory)]
