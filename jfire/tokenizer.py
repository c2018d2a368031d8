"""Tokenizers for jfire: byte-level BPE from a GGUF file, a HF tokenizer.json or a tiktoken
rank file (Kimi K2's `tiktoken.model`, see jfire.tiktoken_bpe), chat templates rendered the
way HF transformers renders them, and incremental detokenizing.

The BPE itself is the `tokenizers` library (or `tiktoken` for a tiktoken.model); this module
only assembles it from GGUF metadata, keeps the few facts the engine needs (BOS, EOS ids,
whether to add BOS) and writes a directory that `Tokenizer.from_dir` reads, and for a
tokenizer.json `transformers.AutoTokenizer` too.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

from jfire.errors import TokenizerError

if TYPE_CHECKING:
    import gguf

    from jfire.tiktoken_bpe import TiktokenBPE

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError"]


# GGUF token_type values (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> how text is split before byte-level BPE: "gpt2" (GPT-2's split,
# HF's ByteLevel(use_regex=True)), "digits+gpt2" (every digit isolated first), or one regex.
# The names and rules are llama.cpp's (llama-vocab.cpp), which is what a GGUF's `pre` means.
# "smollm" and the other StarCoder-lineage vocabularies are "digits+gpt2": llama.cpp's rule and
# the upstream SmolLM2 tokenizer.json (Digits(individual_digits) + ByteLevel). transformers
# 5.x's GGUF converter leaves the digit step out for them, which changes the ids only where a
# run of 2+ whitespace characters precedes a digit ("a   1": ["a","ĠĠĠ","1"] vs ["a","ĠĠ","Ġ","1"]).
_PRE_SPLITS: dict[str, str] = {
    # "default" is what old converters wrote when they could not tell; GPT-2's split is
    # transformers' guess too.
    **dict.fromkeys(["default", "gpt2", "mpt", "olmo", "jais"], "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], "digits+gpt2"),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe", "lfm2"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _GPT4O_SPLIT),
}


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = _PRE_SPLITS.get(pre)
    if split is None:
        known = ", ".join(sorted(_PRE_SPLITS))
        raise TokenizerError(f"unsupported GGUF pre-tokenizer type {pre!r}; supported: {known}")
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "gpt2":
        return gpt2
    if split == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table that byte-level vocabularies are spelled in.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


# How many times shorter, in UTF-8 bytes, a normalizer can make a text. A Unicode normal form
# or lowercasing gives every character at least one byte, and none has more than 4; Prepend
# only adds. Any other (Strip, StripAccents, Precompiled, a regex Replace) may drop text.
_NORMALIZER_SHRINK = {"Prepend": 1, "NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4}
# Pre-tokenizers that keep every character of the text (Split and Punctuation unless told to
# remove what they match); others (Whitespace, BertPreTokenizer) drop some.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "UnicodeScripts", "Split", "Punctuation"}


def _normalizer_shrink(spec: dict | None) -> float | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor: float = 1
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":  # a string for a string: as short as the replacement is
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content") or ""
        if pattern is None or not content:
            return None
        return max(1, len(pattern.encode("utf-8")) / len(content.encode("utf-8")))
    return _NORMALIZER_SHRINK.get(str(kind))


def _pre_tokenizer_keeps(spec: dict | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps(part) for part in spec.get("pretokenizers", []))
    return spec.get("type") in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _is_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_is_byte_level(part) for part in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _text_bound(spec: dict) -> tuple[int | None, bytes]:
    """(max_token_bytes, dropped_bytes) of a serialized `tokenizers.Tokenizer` (tokenizer.json)."""
    unbounded: tuple[int | None, bytes] = (None, b"")
    shrink = _normalizer_shrink(spec.get("normalizer"))
    model, added = spec.get("model") or {}, spec.get("added_tokens") or []
    if shrink is None or not _pre_tokenizer_keeps(spec.get("pre_tokenizer")):
        return unbounded
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return unbounded
    # WordPiece, Unigram and WordLevel can map a whole unknown word or run to one token.
    if model.get("type") != "BPE":
        return unbounded
    vocab = model.get("vocab") or {}
    byte_level = _is_byte_level(spec.get("pre_tokenizer"))
    dropped = b""
    if model.get("byte_fallback"):
        pass  # an unknown character becomes its bytes' tokens
    elif model.get("unk_token"):
        if model.get("fuse_unk"):  # a run of unknown characters becomes one token
            return unbounded
    elif byte_level:  # BPE drops a byte it has no token for: counted out of the input's
        dropped = bytes(sorted(b for c, b in _UNICODE_TO_BYTE.items() if c not in vocab))
        if dropped and shrink != 1:  # ... which normalizing would change
            return unbounded
    else:  # ... or a character
        return unbounded
    added_texts = {t["content"] for t in added}

    def piece_bytes(piece: str) -> int:
        # A byte-level piece spells each byte as one character (of up to two UTF-8 bytes).
        if byte_level and piece not in added_texts and all(c in _UNICODE_TO_BYTE for c in piece):
            return len(piece)
        return len(piece.encode("utf-8"))

    longest = max(map(piece_bytes, [*vocab, *added_texts]), default=1)
    if model.get("unk_token"):  # an unknown character becomes one token
        longest = max(longest, 4)
    return math.ceil(longest * shrink), dropped


def _gguf_value(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as serialized AddedTokens.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer | TiktokenBPE,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool,
        chat_template: str | None,
        extra_eos_ids: tuple[int, ...] = (),
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.extra_eos_ids = tuple(int(i) for i in extra_eos_ids)
        for name, token in (("bos", bos_token), ("eos", eos_token)):
            if token is not None and backend.token_to_id(token) is None:
                raise TokenizerError(f"{name} token {token!r} is not in the vocabulary")
        if self.add_bos and bos_token is None:
            raise TokenizerError("add_bos is set but there is no bos token")

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        model = _gguf_value(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"unsupported GGUF tokenizer model {model!r}; only byte-level BPE ('gpt2') is supported"
            )
        tokens: list[str] = _gguf_value(reader, "tokenizer.ggml.tokens")
        merges: list[str] | None = _gguf_value(reader, "tokenizer.ggml.merges")
        if not tokens or not merges:
            raise TokenizerError("GGUF file has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = _gguf_value(reader, "tokenizer.ggml.pre", "default")

        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        special = {t: ty for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)}
        # Ordinary tokens must be spelled in the byte alphabet for BPE to reach them; some
        # converters store them as raw text, so respell those. Control and user-defined tokens
        # stay raw (e.g. '<｜begin▁of▁sentence｜>'): like llama.cpp, they are matched whole in the
        # text, so the added token and the vocabulary entry share one id and the size stays put.
        vocab = {
            t if t in special or set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        bpe = tokenizers.models.BPE(
            vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False
        )
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in special.items() if ty == _CONTROL]
        )
        # User-defined tokens (e.g. '<think>') are matched whole too, but decode as ordinary text.
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in special.items() if ty == _USER_DEFINED]
        )

        def token_at(key: str) -> str | None:
            idx = _gguf_value(reader, key)
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        eos_id = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
        # llama.cpp also ends generation on end-of-turn / end-of-message tokens.
        extra = tuple(
            i
            for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if (i := _gguf_value(reader, k)) is not None and i != eos_id and 0 <= i < len(tokens)
        )
        return cls(
            backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            add_bos=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
            extra_eos_ids=extra,
        )

    @classmethod
    def from_dir(cls, path) -> Tokenizer | None:
        """A HF tokenizer directory: tokenizer.json, or else tiktoken.model, with
        tokenizer_config.json beside it; None when it has neither."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        bos_token = _token_text(config.get("bos_token"))
        eos_token = _token_text(config.get("eos_token"))
        if (path / "tokenizer.json").is_file():
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        elif (path / "tiktoken.model").is_file():
            from jfire.tiktoken_bpe import TiktokenBPE  # tiktoken is needed only for these

            backend = TiktokenBPE.from_files(path / "tiktoken.model", config)
        else:
            return None

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        elif not isinstance(backend, tokenizers.Tokenizer):
            add_bos = False  # upstream's TikTokenTokenizer never adds BOS itself
        else:
            # No flag: the tokenizer.json post-processor decides, as it does for HF.
            bos_id = backend.token_to_id(bos_token) if bos_token else None
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_special[:1] == [bos_id]

        template = config.get("chat_template")
        if isinstance(template, list):  # HF's named-template form
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        extra = [int(i) for i in config.get("extra_eos_token_ids", [])]
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if isinstance(gen_eos, int):
            extra.append(gen_eos)
        elif isinstance(gen_eos, list):
            extra.extend(int(i) for i in gen_eos)
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        extra = tuple(dict.fromkeys(i for i in extra if i != eos_id))
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos=add_bos,
            chat_template=template,
            extra_eos_ids=extra,
        )

    def save(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if not isinstance(self.backend, tokenizers.Tokenizer):
            self._save_tiktoken(path)
            return
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        # Readers that trust tokenizer.json (older transformers, `tokenizers` alone) then add BOS
        # exactly when we do; transformers 5 rebuilds the same thing from add_bos_token.
        single = f"{self.bos_token}:0 $A:0" if self.add_bos else "$A:0"
        pair = f"{single} {self.bos_token}:1 $B:1" if self.add_bos else "$A:0 $B:1"
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(self.bos_token, self.bos_id)] if self.add_bos else []
        )
        backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "extra_eos_token_ids": list(self.extra_eos_ids),
        }
        self._save_config(path, config)

    def _save_tiktoken(self, path: Path) -> None:
        # tiktoken.model and the config that names its specials. (transformers reads such a
        # directory with its own split pattern, not Kimi's: see jfire.tiktoken_bpe.)
        self.backend.save(path)
        config = {
            "added_tokens_decoder": self.backend.added_tokens_decoder,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "extra_eos_token_ids": list(self.extra_eos_ids),
        }
        self._save_config(path, config)

    def _save_config(self, path: Path, config: dict) -> None:
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        # A stale template file would override the one in the config on the next load.
        (path / "chat_template.jinja").unlink(missing_ok=True)

    # ---- facts --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = set(self.extra_eos_ids)
        if self.eos_token is not None:
            ids.add(self.backend.token_to_id(self.eos_token))
        return frozenset(ids)

    @property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of input text that one token can stand for, `dropped_bytes`
        aside, or None where no bound holds (a normalizer or pre-tokenizer that can drop text,
        an unknown token that fuses a run of characters, an added token that strips the
        whitespace beside it). A text of more than n times this many bytes cannot be n tokens
        or fewer, which a server checks before it tokenizes."""
        return self._text_bound[0]

    @property
    def dropped_bytes(self) -> bytes:
        """The byte values a byte-level vocabulary has no token for: the BPE drops them from
        the text (the default model's has none for 6 ASCII control characters, for instance)."""
        return self._text_bound[1]

    @cached_property
    def _text_bound(self) -> tuple[int | None, bytes]:
        # Reads the whole vocabulary, once.
        if not isinstance(self.backend, tokenizers.Tokenizer):  # tiktoken: bytes in, no normalizing
            longest = max(
                max(len(token) for token in self.backend.ranks),
                max((len(s.encode("utf-8")) for s in self.backend.specials), default=0),
            )
            return longest, b""
        return _text_bound(json.loads(self.backend.to_str()))

    # ---- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # BOS is added here, not by the backend's post-processor, so `add_bos` is the only switch.
        # A batch of one: `tokenizers` lets go of the GIL in encode_batch only (encode holds it,
        # a second per megabyte, and every other thread, the engine's and the server's, waits).
        # tiktoken lets go of it in encode.
        if isinstance(self.backend, tokenizers.Tokenizer):
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token `text` is (a control marker, not text: decoding skips
        it), or None if it is not one."""
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self.decode(ids, skip_special_tokens=True) == "" else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token can be part of a UTF-8
        character, which decoding it alone would turn into U+FFFD): logprobs report them."""
        token_id = int(token_id)
        if not isinstance(self.backend, tokenizers.Tokenizer):
            return self.backend.encoding.decode_single_token_bytes(token_id)
        text = self.decode([token_id], skip_special_tokens=False)
        piece = self.backend.id_to_token(token_id)
        if "\ufffd" in text and piece is not None and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return text.encode("utf-8")

    def stream_decoder(self, *, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self):
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # Jinja's own tojson HTML-escapes; templates expect plain JSON (as HF renders it).
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TokenizerError(f"chat template does not parse: {e}") from e

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> str:
        template = self._compiled_template
        # HF drops None-valued keys first: APIs send content=None and templates would print "None".
        messages = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        context = {
            "tools": None,
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
        }
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # As HF's apply_chat_template(tokenize=True): templates write their own BOS, so none is added.
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e


class StreamDecoder:
    """Incremental detokenizer: push(token_id) -> str returns newly completed text, never
    splitting a multi-byte UTF-8 char (hold back while the decoded text ends with U+FFFD);
    flush() returns the rest.

    Decodes a short window of ids rather than the whole sequence (O(1) per token). The window
    starts at the previous emit point, not at the unread ids, so decoders that treat the first
    token specially (sentencepiece's leading space) strip the same text from both halves.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this have been emitted

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        seen = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if not final and (len(full) <= len(seen) or full.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(seen) :]
