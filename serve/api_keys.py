"""The API keys a server requires, and what it derives from them.

Keys reach a server through the environment ($JFIRE_API_KEY: one key) or a file
(--api-key-file: one key a line, blank lines and lines starting with '#' ignored, readable by
its owner only), never through another process's command line; `--api-key KEY` is kept for
compatibility, and shows in `ps`. Every endpoint but /health then needs
`Authorization: Bearer <one of the keys>`, compared against each key in constant time.

With per-key cache salts (`--cache-salt-per-key`), each key's requests hash their prompts
apart (jfire.kv_cache.block_hashes), so one client can neither reuse nor, through
`usage.prompt_tokens_details.cached_tokens`, detect another's cached prefix. The salt is an
HMAC of the key (and of the request's own cache_salt) under a key of the server's: it travels to
a deployment's groups, the key never does, and no client can send another key's salt.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path

from jfire.deployment_secret import read_owner_only
from jfire.errors import JfireError

ENV = "JFIRE_API_KEY"
FILE_HELP = "one key a line; blank lines and lines starting with '#' are ignored"


def gather(key: str | None, key_file: str | Path | None) -> tuple[str, ...]:
    """Every key a server takes: `key` (from $JFIRE_API_KEY or --api-key) and those of
    `key_file`; () when neither is given (the API is open)."""
    keys = [_checked(key, f"the API key (--api-key or ${ENV})")] if key else []
    if key_file is not None:
        keys += read_file(Path(key_file))
    return tuple(dict.fromkeys(keys))


def read_file(path: Path) -> list[str]:
    """The keys of an API key file, which only its owner may read: anyone who can read it can
    use the API as any of its clients."""
    text = read_owner_only(path, f"the API key file {path}")
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(_checked(line, f"line {number} of the API key file {path}"))
    if not keys:
        raise JfireError(f"the API key file {path} holds no key ({FILE_HELP})")
    return keys


def _checked(key: str, where: str) -> str:
    """A key that can travel in an Authorization header as it is: visible ASCII, no spaces
    (a key with a trailing comment or two keys on one line would never match)."""
    if not all("!" <= c <= "~" for c in key):
        raise JfireError(f"{where} holds a space or a character outside visible ASCII; {FILE_HELP}")
    return key


def matches(authorization: str | None, keys: Sequence[str]) -> bool:
    """Whether an Authorization header is `Bearer <one of keys>`. Every key is compared, in
    constant time, whichever matched: how long it takes says nothing of which key, or how much
    of one, was right."""
    given = (authorization or "").encode("latin-1", "replace")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, b"Bearer " + key.encode())
    return found


def bearer(authorization: str | None) -> str:
    """The key an Authorization header carries ("" without one)."""
    scheme, _, key = (authorization or "").partition(" ")
    return key if scheme == "Bearer" else ""


def salt_for(salt_key: bytes, api_key: str, cache_salt: str | None) -> str:
    """The cache salt of a request sent with `api_key` (and its own `cache_salt`, if any): an
    HMAC under the server's `salt_key`, so the same key always hashes alike, different keys
    never do, and nothing a client sends can equal another key's salt."""
    mac = hmac.new(salt_key, digestmod=hashlib.sha256)
    for part in (api_key.encode(), (cache_salt or "").encode()):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return "key-" + mac.hexdigest()
