"""The deployment secret: what every process of a deployment, or of a lock-step group, shares
so that its channels can tell a member from a stranger.

`jfire launch` makes one per launch (or takes the operator's from the environment or a file,
never from argv) and hands it to each process through the environment. Nothing sends the
secret itself over the network: each use derives its own key from it (HMAC-SHA256 with the
use's name), so that a key seen on one channel (the control servers' bearer token, on plain
HTTP) cannot sign what another channel checks (lock-step payloads, store values, KV sums).

Where it comes from, first found wins:
  $JFIRE_DEPLOYMENT_SECRET       the secret itself (hex, at least 32 bytes' worth), or
  $JFIRE_DEPLOYMENT_SECRET_FILE  a file holding it, readable by its owner only (0600).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from jfire.errors import JfireError

ENV = "JFIRE_DEPLOYMENT_SECRET"
FILE_ENV = "JFIRE_DEPLOYMENT_SECRET_FILE"
MIN_BYTES = 32  # 256 bits: not guessable, and a full HMAC-SHA256 key
TAG_BYTES = 32  # an HMAC-SHA256 tag, whole


@dataclasses.dataclass(frozen=True, repr=False)
class DeploymentSecret:
    key: bytes

    def __post_init__(self):
        if len(self.key) < MIN_BYTES:
            raise JfireError(f"a deployment secret must be at least {MIN_BYTES} bytes, got {len(self.key)}")

    def __repr__(self) -> str:  # never printed, logged or put in a traceback's locals by accident
        return "DeploymentSecret(<hidden>)"

    @classmethod
    def generate(cls) -> DeploymentSecret:
        return cls(secrets.token_bytes(MIN_BYTES))

    @classmethod
    def from_hex(cls, text: str, where: str) -> DeploymentSecret:
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise JfireError(
                f"{where} is not a hex string: a deployment secret is {2 * MIN_BYTES} hex digits"
            ) from None
        if len(key) < MIN_BYTES:
            raise JfireError(f"{where} holds {len(key)} bytes: a deployment secret needs at least {MIN_BYTES}")
        return cls(key)

    def hex(self) -> str:
        return self.key.hex()

    def derive(self, purpose: str) -> bytes:
        """The key of one use of the secret (e.g. "control", "lockstep", "store", "kv")."""
        return hmac.new(self.key, b"jfire/" + purpose.encode(), hashlib.sha256).digest()

    def sign(self, purpose: str, *parts: bytes) -> bytes:
        """An HMAC-SHA256 tag over the parts (each length-prefixed, so no two splits of the same
        bytes sign alike), under the purpose's own key."""
        mac = hmac.new(self.derive(purpose), digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "little"))
            mac.update(part)
        return mac.digest()

    def verify(self, purpose: str, tag: bytes, *parts: bytes) -> bool:
        """Whether `tag` is sign(purpose, *parts), compared in constant time."""
        return hmac.compare_digest(tag, self.sign(purpose, *parts))

    def bearer(self) -> str:
        """The control servers' token: `Authorization: Bearer <this>` (derived, so seeing it on
        the wire reveals nothing that signs payloads)."""
        return self.derive("control").hex()

    def check_bearer(self, header: str | None) -> bool:
        """Whether an Authorization header carries this secret's control token (constant time)."""
        expected = f"Bearer {self.bearer()}".encode()
        return hmac.compare_digest((header or "").encode("latin-1", "replace"), expected)


def from_env(environ: Mapping[str, str] | None = None) -> DeploymentSecret | None:
    """The secret this process was given ($JFIRE_DEPLOYMENT_SECRET or the file named by
    $JFIRE_DEPLOYMENT_SECRET_FILE), or None if neither is set."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        return DeploymentSecret.from_hex(env[ENV], f"${ENV}")
    if env.get(FILE_ENV):
        return read_file(Path(env[FILE_ENV]))
    return None


def missing(what: str) -> str:
    """What to tell an operator who started `what` without a secret: how to make one, and
    where each of its processes looks for it."""
    return (
        f"{what} needs the deployment secret, the same in each of its processes: make one with "
        "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE; chmod 600 FILE` and set "
        f"${FILE_ENV}=FILE (or ${ENV} to its contents) in every process's environment"
    )


def read_file(path: Path) -> DeploymentSecret:
    """The secret in a file that only its owner may read (a looser file is refused: anyone who
    can read it can join the deployment)."""
    what = f"the deployment secret file {path}"
    return DeploymentSecret.from_hex(read_owner_only(path, what), what)


def read_owner_only(path: Path, what: str) -> str:
    """The text of a file of secrets (`what` names it in errors), refused unless only its owner
    may read or write it: anyone else who could read it holds what it grants."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise JfireError(f"cannot read {what}: {getattr(e, 'strerror', None) or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise JfireError(f"{what} is readable by others (mode {stat.S_IMODE(mode):o}); run 'chmod 600 {path}'")
    return text


def write_file(path: Path, secret: DeploymentSecret) -> None:
    """Writes the secret to `path`, created 0600 (never readable by others, even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, (secret.hex() + "\n").encode())
    finally:
        os.close(fd)


def to_env(secret: DeploymentSecret) -> dict[str, str]:
    """What a child process's environment carries so that it has the secret (never its argv)."""
    return {ENV: secret.hex()}
