"""The one check a request passes before any engine queues it.

A server's schemas check each field alone (types, ranges); `RequestChecks.check` checks the
request against the model and the engine (vocabulary, context, grammar, KV pages). Every
refusal is a `RequestError` naming the request field it is about, so a server reports the
field without reading the message. `TextLimit` checks a prompt's text before it is tokenized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from jfire.errors import QueueFull, RequestError
from jfire.grammar import GrammarError, Grammars
from jfire.sampling import SamplingParams
from jfire.stop_strings import stop_limit_error

if TYPE_CHECKING:
    from jfire.tokenizer import Tokenizer


def context_limit(cfg, requested: int | None) -> int:
    """Tokens a request may span: `requested` (--max-context), else the model's context capped
    at 4096; never more than the model's."""
    return min(requested or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class TextLimit:
    """How many bytes a prompt's text may have before it is tokenized: a prompt holds at most
    `tokens` tokens (the context less one for the output), each of at most `token_bytes` bytes
    (bytes in `dropped`, which the tokenizer drops, aside). More bytes than that cannot fit
    however they tokenize, and tokenizing them would take a second per megabyte for nothing."""

    tokens: int
    token_bytes: int
    dropped: bytes = b""

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, max_model_len: int) -> TextLimit | None:
        """None without a tokenizer, or with one whose tokens may stand for any amount of text."""
        if tokenizer is None or tokenizer.max_token_bytes is None:
            return None
        return cls(max_model_len - 1, tokenizer.max_token_bytes, tokenizer.dropped_bytes)

    @property
    def max_bytes(self) -> int:
        return self.tokens * self.token_bytes

    def check(self, text: str) -> None:
        """Raises RequestError (param "prompt") for a text with more bytes than the context can hold."""
        if 4 * len(text) <= self.max_bytes:  # no character has more than 4 bytes
            return
        data = text.encode("utf-8", errors="surrogatepass")
        counted = len(data.translate(None, self.dropped)) if self.dropped and len(data) > self.max_bytes else len(data)
        if counted > self.max_bytes:
            dropped = f" ({counted} without the bytes the tokenizer drops)" if counted != len(data) else ""
            raise RequestError(
                f"the prompt is {len(data)} bytes of text{dropped} but the context holds at most {self.max_bytes}: "
                f"{self.tokens} tokens of at most {self.token_bytes} bytes each; shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )


@dataclasses.dataclass
class RequestChecks:
    """What a request is checked against. `kv_shortfall(positions)` says which KV pool one
    sequence of that many positions can never fit in: (group, pages needed, pages it has), or
    None (itself None where another process holds the pools: a deployment's frontend leaves
    that check to its decode group). `queue()` says how many requests wait and how many may
    (None: no bound)."""

    vocab_size: int
    max_model_len: int
    grammars: Grammars
    has_tokenizer: bool
    kv_shortfall: Callable[[int], tuple[str, int, int] | None] | None = None
    queue: Callable[[], tuple[int, int]] | None = None

    def admit(self, n: int = 1) -> None:
        """Raises QueueFull unless the waiting queue has room for n more requests now (each of
        a request's choices takes a place), or RequestError (param "n") when it never will.
        A server asks before anything costly, such as compiling the request's grammar; each
        submit asks again."""
        if self.queue is None:
            return
        waiting, limit = self.queue()
        if n > limit:
            raise RequestError(
                f"n: {n} choices are more requests than the waiting queue holds ({limit}); ask for at most {limit}",
                param="n",
                code="invalid_value",
            )
        if waiting + n > limit and n == 1:
            raise QueueFull(f"the waiting queue is full ({limit} requests); retry later")
        if waiting + n > limit:
            raise QueueFull(
                f"the waiting queue has room for {max(limit - waiting, 0)} of this request's {n} choices "
                f"(it holds {limit} requests); retry later"
            )

    def check(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raises RequestError when this request can never run; nothing is queued."""
        if not prompt_ids:
            raise RequestError("the prompt is empty; give at least one token", param="prompt")
        # The length before the ids: a server may check on its event loop, and a prompt of
        # millions of ids is refused without reading them.
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise RequestError(
                f"the prompt has {n} tokens but the context holds {limit}; shorten the prompt to at most "
                f"{limit - 1} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        bad = [i for i in prompt_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        bad = [i for i in sampling.stop_token_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(
                f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                param="stop_token_ids",
                code="invalid_value",
            )
        if n + sampling.max_tokens > limit:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the context of "
                f"{limit}; use max_tokens <= {limit - n}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if sampling.stop and not self.has_tokenizer:
            raise RequestError(
                "stop strings need a tokenizer; this model has none (use EOS or max_tokens)", param="stop"
            )
        stop_error = stop_limit_error(sampling.stop)
        if stop_error is not None:
            raise RequestError(f"stop: {stop_error}", param="stop", code="invalid_value")
        if sampling.grammar is not None:
            # Compiles the grammar (kept for the request's matchers): a server calls this off
            # its event loop first, so the call on submit finds it compiled.
            try:
                self.grammars.validate(sampling.grammar)
            except GrammarError as e:
                raise RequestError(f"response_format: {e}", param="response_format", code="invalid_value") from None
        short = self.kv_shortfall(n + sampling.max_tokens) if self.kv_shortfall is not None else None
        if short is not None:
            group, needed, has = short
            pool = "the pool" if group in ("full", "shared") else f"the {group} layers' pool"
            raise RequestError(
                f"this request needs {needed} KV pages but {pool} has {has}; lower max_tokens or enlarge the KV cache",
                param="max_tokens",
            )
