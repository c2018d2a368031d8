"""jax.distributed's key-value store client, in memory, for tests of what reads and writes it:
the client's method names, its key normalisation, its errors (NotFound, a blocking read's
deadline) as plain runtime errors."""

from __future__ import annotations

from jfire.disagg.signed_store import normalize


class MemoryClient:
    def __init__(self):
        self.values: dict[str, bytes] = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        if not allow_overwrite and normalize(key) in self.values:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.values[normalize(key)] = bytes(value)

    def key_value_set(self, key, value, allow_overwrite=False):
        self.key_value_set_bytes(key, value.encode(), allow_overwrite)

    def key_value_try_get_bytes(self, key):
        if normalize(key) not in self.values:
            raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.values[normalize(key)]

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if normalize(key) not in self.values:
            raise RuntimeError("DEADLINE_EXCEEDED")
        return self.values[normalize(key)]

    def key_value_dir_get_bytes(self, directory):
        prefix = normalize(directory) + "/"
        return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(prefix)]

    def key_value_delete(self, key):
        self.values.pop(normalize(key), None)

    def key_value_increment(self, key, n):
        count = int(self.values.get(normalize(key), b"0")) + n
        self.values[normalize(key)] = str(count).encode()
        return count
