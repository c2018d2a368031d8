"""The one check a request passes before any engine queues it.

A server's schemas check each field alone (types, ranges); `RequestChecks.check` checks the
request against the model and the engine (vocabulary, context, grammar, KV pages). Every
refusal is a `RequestError` naming the request field it is about, so a server reports the
field without reading the message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jfire.errors import RequestError
from jfire.grammar import GrammarError, Grammars
from jfire.sampling import SamplingParams


def context_limit(cfg, requested: int | None) -> int:
    """Tokens a request may span: `requested` (--max-context), else the model's context capped
    at 4096; never more than the model's."""
    return min(requested or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)


@dataclasses.dataclass
class RequestChecks:
    """What a request is checked against. `pages_needed` and `num_pages` are the KV pool's
    (None where another process holds the pool: a deployment's frontend leaves that check to
    its decode group)."""

    vocab_size: int
    max_model_len: int
    grammars: Grammars
    has_tokenizer: bool
    pages_needed: Callable[[int], int] | None = None
    num_pages: int | None = None

    def check(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raises RequestError when this request can never run; nothing is queued."""
        if not prompt_ids:
            raise RequestError("the prompt is empty; give at least one token", param="prompt")
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
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise RequestError(
                f"the prompt has {n} tokens but the context holds {limit}; shorten the prompt to at most "
                f"{limit - 1} tokens",
                param="prompt",
                code="context_length_exceeded",
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
        if sampling.grammar is not None:
            try:
                self.grammars.validate(sampling.grammar)
            except GrammarError as e:
                raise RequestError(str(e), param="response_format", code="invalid_value") from None
        if self.pages_needed is not None and self.num_pages is not None:
            needed = self.pages_needed(n + sampling.max_tokens)
            if needed > self.num_pages:
                raise RequestError(
                    f"this request needs {needed} KV pages but the pool has {self.num_pages}; lower max_tokens "
                    "or enlarge the KV cache",
                    param="max_tokens",
                )
