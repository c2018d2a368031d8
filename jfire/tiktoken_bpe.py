"""Kimi K2 / K2.5's tokenizer: a tiktoken rank file (`tiktoken.model`, lines of
`base64(token bytes) rank`) plus special tokens named in tokenizer_config.json, run by the
`tiktoken` package the way upstream's remote code (moonshotai's tokenization_kimi.py) runs it:
Kimi's split pattern, special ids from the rank count on, unnamed ones `<|reserved_token_{id}|>`,
special tokens in the text recognised as specials.

`TiktokenBPE` answers the calls `jfire.tokenizer.Tokenizer` makes of a `tokenizers.Tokenizer`
(`encode(...).ids`, `decode`, `token_to_id`, `get_vocab_size`), so Tokenizer runs either one
without branching.

transformers (5.x, without remote code) also reads a `tiktoken.model`, but splits the text
with its default cl100k-style pattern instead of Kimi's, so its ids can differ from upstream's
(" it's" is one piece for Kimi, " it" + "'s" for cl100k); this module keeps Kimi's pattern.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from jfire.errors import TokenizerError

__all__ = ["KIMI_PATTERN", "TiktokenBPE", "read_ranks", "write_ranks"]

MODEL_FILE = "tiktoken.model"

# Verbatim from tokenization_kimi.py. `&&` is character-class intersection: tiktoken's regex
# engine (Rust fancy-regex) and Oniguruma read it so; Python's `regex` only in V1 mode.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Upstream reserves this many ids after the ranks for special tokens, named or not.
NUM_RESERVED_SPECIAL_TOKENS = 256

# Upstream cuts the text before tiktoken sees it: into 400k-character pieces (tiktoken's limit)
# and wherever a run of whitespace or of non-whitespace passes 25k characters (tiktoken's BPE
# is quadratic in a split piece's length, tiktoken issue #195). The cuts change ids only inside
# such runs; they are kept so the ids stay upstream's.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
# Maximal runs of whitespace or of non-whitespace; Python's \s is str.isspace(), upstream's test.
_RUN = re.compile(r"\s+|\S+")


def read_ranks(path) -> dict[bytes, int]:
    """The rank file as {token bytes: rank}; ranks must be exactly 0..n-1 (special ids follow
    them) and cover every single byte (so any text encodes)."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError(f"{len(fields)} fields")
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
                if rank < 0:
                    raise ValueError("negative rank")
            except (ValueError, binascii.Error) as e:
                raise TokenizerError(f"{path}, line {lineno}: expected 'base64-token rank' ({e}): {line[:80]!r}") from e
            if token in ranks:
                raise TokenizerError(f"{path}, line {lineno}: token {token!r} already has rank {ranks[token]}")
            if rank in line_of_rank:
                raise TokenizerError(f"{path}, line {lineno}: rank {rank} already given on line {line_of_rank[rank]}")
            ranks[token], line_of_rank[rank] = rank, lineno
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens")
    if max(line_of_rank) != len(ranks) - 1:
        gap = min(set(range(len(ranks))) - line_of_rank.keys())
        raise TokenizerError(
            f"{path}: ranks must run 0..{len(ranks) - 1} (special ids follow them); no token has rank {gap}"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: single bytes {missing[:8]} have no rank, so some text cannot be encoded")
    return ranks


def write_ranks(ranks: dict[bytes, int], path) -> None:
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def _pieces(text: str):
    """Upstream's cuts of `text` (see _MAX_RUN_CHARS); each piece is encoded on its own. A run
    is cut every _MAX_RUN_CHARS characters from its start, as upstream's counter does."""
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[start : start + _MAX_ENCODE_CHARS]
        cut = 0
        if len(chunk) > _MAX_RUN_CHARS:
            for run in _RUN.finditer(chunk):
                for i in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                    yield chunk[cut:i]
                    cut = i
        yield chunk[cut:]


@dataclass(frozen=True)
class _Encoding:
    ids: list[int]


class TiktokenBPE:
    def __init__(self, ranks: dict[bytes, int], added: dict[int, dict], *, name: str = MODEL_FILE):
        """`added`: tokenizer_config.json's added_tokens_decoder ({id: {"content": ..., "special": ...}})."""
        self.ranks = ranks
        n_base = len(ranks)
        named: dict[int, dict] = {}
        for key, entry in added.items():
            try:
                i = int(key)
            except ValueError:
                raise TokenizerError(f"added_tokens_decoder key {key!r} is not a token id") from None
            entry = entry if isinstance(entry, dict) else {"content": entry}
            if not isinstance(entry.get("content"), str) or not entry["content"]:
                raise TokenizerError(f"added_tokens_decoder[{key}] has no token text")
            # Upstream only builds specials from the rank count on; an entry below it names a
            # token the ranks already spell.
            if i >= n_base:
                named[i] = {"content": entry["content"], "special": bool(entry.get("special", True))}
        end = max(n_base + NUM_RESERVED_SPECIAL_TOKENS, max(named, default=-1) + 1)
        self.added = named
        self.specials: dict[str, int] = {}
        for i in range(n_base, end):
            content = named[i]["content"] if i in named else f"<|reserved_token_{i}|>"
            if content in self.specials:
                raise TokenizerError(f"special token {content!r} names both id {self.specials[content]} and id {i}")
            self.specials[content] = i
        self.n_base = n_base
        # Skipped by decode(skip_special_tokens=True): all specials but those marked "special": false
        # (as transformers skips added tokens flagged special).
        self._skippable = frozenset(i for i in range(n_base, end) if named.get(i, {}).get("special", True))
        self.encoding = tiktoken.Encoding(
            name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=self.specials
        )

    @classmethod
    def from_files(cls, model_path, config: dict) -> TiktokenBPE:
        added = config.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise TokenizerError("tokenizer_config.json: added_tokens_decoder must map token ids to tokens")
        return cls(read_ranks(model_path), added, name=Path(model_path).name)

    # ---- the slice of tokenizers.Tokenizer's API that jfire.tokenizer.Tokenizer calls -------

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        # Specials are never added here (Tokenizer adds BOS); ones written in the text are matched.
        ids: list[int] = []
        for piece in _pieces(text):
            ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return _Encoding(ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids, size = [int(i) for i in ids], self.get_vocab_size()
        bad = next((i for i in ids if not 0 <= i < size), None)
        if bad is not None:
            raise TokenizerError(f"token id {bad} is outside the vocabulary (0..{size - 1})")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skippable]
        # Bytes that do not end a UTF-8 character come out as U+FFFD, which StreamDecoder holds back on.
        return self.encoding.decode(ids, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        # A special by its name, an ordinary token by its text.
        if token in self.specials:
            return self.specials[token]
        return self.ranks.get(token.encode("utf-8"))

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.n_base + len(self.specials) if with_added_tokens else self.n_base

    # ---- saving -------------------------------------------------------------------------

    def save(self, path) -> None:
        """Writes tiktoken.model into directory `path`."""
        write_ranks(self.ranks, Path(path) / MODEL_FILE)

    @property
    def added_tokens_decoder(self) -> dict[str, dict]:
        """What tokenizer_config.json needs to rebuild the same specials."""
        return {str(i): dict(e) for i, e in sorted(self.added.items())}
