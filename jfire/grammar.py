"""Constrained decoding with llguidance: grammars built from JSON schemas, regexes or Lark,
and the per-step token masks that the device applies inside sampling (jfire.sampling).

llguidance (not xgrammar) because it depends on nothing but numpy, needs no per-schema
compilation step (a matcher is ready in about a millisecond), and computes a mask in tens of
microseconds on the host while the device runs the previous step; see docs/structured-outputs.md
for the comparison measured on this machine.

A grammar travels as llguidance's serialized form (a string), so a disaggregated request's
prefill and decode groups each build their own matcher from it. Compiling a matcher is the
expensive part (seconds for a schema of a few hundred kilobytes): `Grammars` compiles each
grammar once and keeps it, and every matcher after that is a copy of the kept one.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

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
    if error:
        raise _refusal(error, "invalid JSON schema")


def _refusal(error: str, what: str) -> GrammarError:
    """llguidance's error as jfire says it: a keyword it cannot enforce by name, anything else
    after `what`."""
    unsupported = re.search(r"Unimplemented keys: \[(.*?)\]", error)
    if unsupported:
        return GrammarError(
            f"the JSON schema uses {unsupported.group(1)}, which jfire cannot enforce; "
            "remove the keyword or express the constraint with supported ones"
        )
    return GrammarError(f"{what}: {error}")


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


class Grammars:
    """Matchers for one tokenizer. The llguidance tokenizer takes about a second to build, so
    it is built once, on the first constrained request. Each grammar is compiled once and the
    `keep` most recently used are kept: a request's check and each of its choices' matchers
    share one compile. Call `validate` where waiting is harmless (a server's worker thread):
    `matcher` then only copies."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, keep: int = 8):
        self._tokenizer, self._vocab_size, self._eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltokenizer = None
        self._tokenizer_lock = threading.Lock()
        # A 200 KB schema's compiled matcher holds about 13 MB; most are far smaller.
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._compiled_lock = threading.Lock()  # held for lookups only, never while compiling
        self._keep = keep

    def _ll(self):
        lib = _library()
        with self._tokenizer_lock:
            if self._lltokenizer is None:
                if self._tokenizer is None:
                    raise GrammarError("constrained decoding needs the model's tokenizer; this model has none")
                self._lltokenizer = _lltokenizer(lib, self._tokenizer, self._vocab_size, self._eos_ids)
        return self._lltokenizer

    def validate(self, grammar: str) -> None:
        """Raises GrammarError when the grammar cannot be used (a schema llguidance refuses);
        compiles it if it is not kept yet."""
        self._compiled_matcher(grammar)

    def matcher(self, grammar: str):
        """A matcher of the grammar in its start state, of its own to advance."""
        return self._compiled_matcher(grammar).deep_copy()

    def _compiled_matcher(self, grammar: str):
        """The kept matcher of the grammar (never advanced: only copied), compiled if need be.
        Two threads asking for a grammar nobody has compiled yet may both compile it."""
        with self._compiled_lock:
            kept = self._compiled.get(grammar)
            if kept is not None:
                self._compiled.move_to_end(grammar)
                return kept
        matcher = _library().LLMatcher(self._ll(), grammar, log_level=0)  # lets go of the GIL
        if matcher.is_error():
            raise _refusal(matcher.get_error(), "the schema or grammar cannot be used")
        with self._compiled_lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > self._keep:
                self._compiled.popitem(last=False)
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
