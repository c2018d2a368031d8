"""Constrained decoding with llguidance: grammars built from JSON schemas, regexes or Lark,
and the per-step token masks that the device applies inside sampling (jfire.sampling).

llguidance (not xgrammar) because it depends on nothing but numpy, needs no per-schema
compilation step (a matcher is ready in about a millisecond), and computes a mask in tens of
microseconds on the host while the device runs the previous step; see docs/structured-outputs.md
for the comparison measured on this machine.

A grammar travels as llguidance's serialized form (a string), so a disaggregated request's
prefill and decode groups each build their own matcher from it.
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np

from jfire.errors import JfireError

try:
    import llguidance
    import llguidance.numpy as llg_numpy
except ImportError:  # pragma: no cover - a dependency; the message says how to get it
    llguidance = None


class GrammarError(JfireError):
    """A schema or grammar that cannot be used: the message says what is wrong."""


def _library():
    if llguidance is None:
        raise GrammarError("constrained decoding needs the llguidance package: pip install llguidance")
    return llguidance


# One JSON layout, spaced as models write it: free whitespace would let a small model pad
# with newlines for ever instead of closing the document.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict | bool) -> str:
    """A grammar for JSON documents that satisfy `schema`, exactly as it is written (strict
    or not: the output always satisfies it; "additionalProperties": false forbids keys the
    schema does not list)."""
    lib = _library()
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return lib.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def check_json_schema(schema: dict | bool) -> None:
    """Raises GrammarError unless llguidance can enforce `schema` in full. One rule wherever a
    schema constrains output (response_format, tool arguments): a keyword it cannot enforce is
    refused by name, never silently dropped."""
    lib = _library()
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        error = lib.LLMatcher.validate_grammar(lib.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    except (ValueError, TypeError) as e:
        error = str(e)
    if not error:
        return
    unsupported = re.search(r"Unimplemented keys: \[(.*?)\]", error)
    if unsupported:
        raise GrammarError(
            f"the JSON schema uses {unsupported.group(1)}, which jfire cannot enforce; "
            "remove the keyword or express the constraint with supported ones"
        )
    raise GrammarError(f"invalid JSON schema: {error}")


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


class Grammars:
    """Matchers for one tokenizer. The llguidance tokenizer takes about a second to build, so
    it is built once, on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._tokenizer, self._vocab_size, self._eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()

    def _ll(self):
        lib = _library()
        with self._lock:
            if self._lltokenizer is None:
                if self._tokenizer is None:
                    raise GrammarError("constrained decoding needs the model's tokenizer; this model has none")
                self._lltokenizer = _lltokenizer(lib, self._tokenizer, self._vocab_size, self._eos_ids)
        return self._lltokenizer

    def validate(self, grammar: str) -> None:
        """Raises GrammarError when the grammar cannot be used (a schema llguidance refuses)."""
        self.matcher(grammar)

    def matcher(self, grammar: str):
        lib = _library()
        matcher = lib.LLMatcher(self._ll(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the schema or grammar cannot be used: {matcher.get_error()}")
        return matcher


def _lltokenizer(lib, tokenizer, vocab_size: int, eos_ids):
    backend = tokenizer.backend
    eos = eos_ids or None
    if hasattr(backend, "to_str"):  # a tokenizers.Tokenizer
        return lib.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    encoding = backend.encoding  # jfire.tiktoken_bpe.TiktokenBPE
    return lib.LLTokenizer.from_tiktoken(
        encoder=encoding._mergeable_ranks,
        special_tokens=encoding._special_tokens,
        pattern=encoding._pat_str,
        eos_token=eos,
        n_vocab=vocab_size,
    )


def fill_mask(matcher, mask: np.ndarray, row: int) -> None:
    """Writes the tokens `matcher` allows next into mask[row] (int32 words, bit per token)."""
    llg_numpy.fill_next_token_bitmask(matcher, mask, row)


def ban(mask: np.ndarray, row: int, token_ids) -> None:
    """Clears the bits of token_ids in mask[row] (EOS before min_tokens)."""
    for t in token_ids:
        mask[row, t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)
