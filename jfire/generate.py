"""Generating one sequence: prefill the prompt, then decode token by token.

This is the single-sequence path behind `jfire generate`; shapes are padded to power-of-two
buckets so a handful of compiled programs serve every prompt and length.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax.numpy as jnp
import numpy as np

from jfire import programs
from jfire.checkpoint.load import LoadedModel
from jfire.errors import JfireError
from jfire.models.llama import init_cache
from jfire.sampling import SamplingParams
from jfire.tokenizer import find_stop, holdback

MIN_BUCKET = 16


def bucket(n: int, cap: int | None = None) -> int:
    """The smallest power of two >= n (at least MIN_BUCKET), capped at `cap`."""
    size = max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())
    return min(size, cap) if cap else size


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, including an EOS that ended the sequence
    text: str | None  # None when the model has no tokenizer
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


class Generator:
    """Runs prompts through the prefill and decode programs of one loaded model."""

    def __init__(self, model: LoadedModel, max_context: int | None = None):
        self.model = model
        self.config = model.config
        self.max_context = min(max_context or self.config.max_position_embeddings, self.config.max_position_embeddings)
        self.eos_ids = set(self.config.eos_token_ids)
        if model.tokenizer is not None:
            self.eos_ids |= set(model.tokenizer.eos_ids)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len == 0:
            raise JfireError("the prompt is empty; give at least one token")
        if prompt_len >= self.max_context:
            raise JfireError(
                f"the prompt has {prompt_len} tokens but the context holds {self.max_context}; "
                f"shorten the prompt to at most {self.max_context - 1} tokens"
            )
        if prompt_len + max_tokens > self.max_context:
            raise JfireError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                f"{self.max_context}; use max_tokens <= {self.max_context - prompt_len}"
            )

    def check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise JfireError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")

    def stream(self, prompt_ids: list[int], sampling: SamplingParams) -> Iterator[int]:
        """Yields generated ids one at a time until EOS or max_tokens (stop strings are the caller's)."""
        self.check_ids(prompt_ids)
        self.check_fits(len(prompt_ids), sampling.max_tokens)
        cfg, params = self.config, self.model.params
        n = len(prompt_ids)
        cache_len = bucket(n + sampling.max_tokens, self.max_context)
        cache = init_cache(cfg, 1, cache_len, params["embed"].dtype)
        t = bucket(n, cache_len)
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :n] = prompt_ids
        positions = np.full((1, t), -1, np.int32)
        positions[0, :n] = np.arange(n)
        seed = jnp.asarray([sampling.resolved_seed()], jnp.uint32)
        knobs = (
            jnp.asarray([sampling.temperature], jnp.float32),
            jnp.asarray([sampling.top_k], jnp.int32),
            jnp.asarray([sampling.top_p], jnp.float32),
        )
        ids, _, cache = programs.prefill(
            params, cache, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray([n - 1], jnp.int32),
            seed, *knobs, cfg=cfg,
        )
        for step in range(sampling.max_tokens):
            token = int(ids[0])
            yield token
            if token in self.eos_ids and not sampling.ignore_eos:
                return
            if step + 1 == sampling.max_tokens:
                return
            position = jnp.asarray([n + step], jnp.int32)
            ids, _, cache = programs.decode(params, cache, ids, position, seed, *knobs, cfg=cfg)

    def complete(self, prompt_ids: list[int], sampling: SamplingParams, on_text=None) -> Completion:
        """Generates to completion, honouring EOS and stop strings; `on_text(delta)` streams text."""
        tokenizer = self.model.tokenizer
        if sampling.stop and tokenizer is None:
            raise JfireError("stop strings need a tokenizer; this model has none (use EOS or max_tokens)")
        decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        generated: list[int] = []
        text, emitted = "", 0
        finish = "length"
        for token in self.stream(prompt_ids, sampling):
            generated.append(token)
            if token in self.eos_ids and not sampling.ignore_eos:
                finish = "stop"
                break
            if decoder is None:
                continue
            text += decoder.push(token)
            cut = find_stop(text, sampling.stop) if sampling.stop else None
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            # Hold back a tail that might be the start of a stop string.
            safe = len(text) - holdback(text, sampling.stop) if sampling.stop else len(text)
            if on_text and safe > emitted:
                on_text(text[emitted:safe])
                emitted = safe
        if decoder is not None and finish == "length":
            text += decoder.flush()
            cut = find_stop(text, sampling.stop) if sampling.stop else None
            if cut is not None:
                text, finish = text[:cut], "stop"
        if on_text and decoder is not None and len(text) > emitted:
            on_text(text[emitted:])
        return Completion(list(prompt_ids), generated, text if decoder is not None else None, finish)
