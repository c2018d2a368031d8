"""The output side of the engine: each sampled token becomes what the request's consumer sees.

`OutputProcessor` owns the requests the engine is running (`LiveRequest`: the scheduler's
`Sequence` plus its output stream and text) and turns each sampled token into a
`RequestOutput`: it detokenizes, applies stop tokens and strings, decides the finish reason,
attaches logprobs, and delivers the step's outputs once the step's stats are published.
It runs on the engine thread only.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

from jfire import faults
from jfire.errors import JfireError
from jfire.grammar import Grammars
from jfire.requests import RequestHandle, RequestOutput
from jfire.scheduler import Sequence
from jfire.stop_strings import StopScan, StopStrings


@dataclasses.dataclass
class LiveRequest:
    """One request the engine holds: its scheduling state, its output stream and text."""

    seq: Sequence
    handle: RequestHandle
    on_output: Callable[[RequestOutput], None]
    decoder: object | None  # the tokenizer's stream decoder; None without a tokenizer
    kv_params: dict | None = None  # what the request brought for the KV connector
    stops: StopScan | None = None  # the output's scan for its stop strings; None without any
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # entry p: of prompt token p + 1
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    """`on_finished(seq)` is called for each request that ends (the engine frees its pages
    and penalty slot); `cancel(request_id)` for one whose consumer failed."""

    def __init__(
        self,
        tokenizer,
        grammars: Grammars,
        eos_ids: frozenset[int],
        max_model_len: int,
        *,
        on_finished: Callable[[Sequence], None],
        cancel: Callable[[str], None],
    ):
        self.tokenizer, self.grammars, self.eos_ids = tokenizer, grammars, eos_ids
        self.max_model_len = max_model_len
        self.on_finished, self.cancel = on_finished, cancel
        self.requests: dict[str, LiveRequest] = {}  # request id -> the request, while it runs
        self.tokens_generated = 0
        self._outbox: list[tuple[LiveRequest, RequestOutput]] = []  # this step's, sent after stats
        # Each set of stop strings is built into its automaton once: a request's choices (and
        # a client repeating its stops) share it.
        self._stop_strings = functools.lru_cache(maxsize=16)(StopStrings)

    def new_request(self, seq: Sequence, handle: RequestHandle, on_output, kv_params: dict | None = None):
        """A request's output side (not yet running: `add` it on the engine thread)."""
        sp = seq.sampling
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=sp.skip_special_tokens) if self.tokenizer else None
        if sp.grammar is not None:
            seq.matcher = self.grammars.matcher(sp.grammar)
        stops = StopScan(self._stop_strings(tuple(sp.stop))) if sp.stop and decoder is not None else None
        return LiveRequest(seq, handle, on_output, decoder, kv_params, stops)

    def add(self, live: LiveRequest) -> None:
        self.requests[live.seq.request_id] = live

    def take_tokens(self, sampled: dict[Sequence, tuple]) -> None:
        """Appends each sequence's sampled (token, logprobs entry) after a step; a request whose
        own processing fails (detokenizing, stop strings) ends alone."""
        for seq, (token, logprobs) in sampled.items():
            live = self.requests[seq.request_id]
            try:
                if faults.before_output is not None:
                    faults.before_output(seq, token)
                self.append(live, token, logprobs)
            except Exception as e:
                self.fail_one(live, e)

    def take_runs(self, runs: dict[Sequence, list[tuple]]) -> None:
        """Several tokens a sequence (a verified row's emitted run): appended one position at a
        time, exactly as decode steps would append them, until the request ends."""
        for j in range(max(map(len, runs.values()), default=0)):
            self.take_tokens(
                {seq: run[j] for seq, run in runs.items() if j < len(run) and seq.request_id in self.requests}
            )

    def append(self, live: LiveRequest, token: int, logprobs: list | None = None) -> None:
        seq, sp = live.seq, live.seq.sampling
        seq.tokens.append(token)
        self.tokens_generated += 1
        finish = None
        ends = (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids
        matcher = seq.matcher
        if matcher is not None and not ends:
            # The token came from the matcher's own mask, so it is accepted; a matcher that
            # refuses it has failed (a bug, not the request's fault): the request ends loudly.
            if not matcher.consume_token(token):  # type: ignore[attr-defined]
                raise JfireError(f"constrained decoding failed: {matcher.get_error()}")  # type: ignore[attr-defined]
            if matcher.is_stopped():  # type: ignore[attr-defined]  # complete: allows nothing more
                finish = "stop"
        if ends:
            finish = "stop"
        elif finish is None and (seq.num_generated >= sp.max_tokens or len(seq.tokens) >= self.max_model_len):
            finish = "length"
        delta, finish = output_text(live, token, ends, finish)
        out = self._output(live, [token], delta, logprobs)
        if finish is not None:
            self.finish(live, finish, last=out)
        else:
            self._outbox.append((live, out))

    def prefilled(self, live: LiveRequest, token: int, logprobs: list | None, transfer: dict) -> None:
        """The prefill role's end of a request: its first token and where its KV waits (the
        decode side checks the token against the grammar, counts it for penalties and
        detokenizes it)."""
        self.tokens_generated += 1
        out = self._output(live, [token], "", logprobs)
        out.completion_tokens, out.transfer = 1, transfer
        self.finish(live, "prefilled", last=out)

    def hand_off(self, sampled: dict[Sequence, tuple], request_finished: Callable) -> None:
        """The prefill role's end of each request (`prefilled`), with where the connector keeps
        its KV (`request_finished(seq, kv_params)`); a request whose own hand-off fails ends alone."""
        for seq, (token, logprobs) in sampled.items():
            live = self.requests[seq.request_id]
            try:
                self.prefilled(live, token, logprobs, request_finished(seq, live.kv_params))
            except Exception as e:
                self.fail_one(live, e)

    def keep_prompt_logprob(self, seq: Sequence, position: int, entry: list) -> None:
        """The logprobs of prompt token position + 1; a recompute after preemption runs the
        position again: the first is kept."""
        live = self.requests[seq.request_id]
        if len(live.prompt_logprobs) == position:
            live.prompt_logprobs.append(entry)

    def finish(self, live: LiveRequest, reason: str, *, last: RequestOutput | None = None, error: str | None = None):
        self.on_finished(live.seq)
        self.requests.pop(live.seq.request_id, None)
        out = last or self._output(live, [], "", None, with_prompt_logprobs=False)
        out.finished, out.finish_reason, out.error = True, reason, error
        self._outbox.append((live, out))

    def fail_one(self, live: LiveRequest, e: Exception) -> None:
        """Ends one request whose own processing failed; the engine serves the others on."""
        print(f"jfire: request {live.seq.request_id} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if live.seq.request_id in self.requests:
            self.finish(live, "error", error=f"request failed: {type(e).__name__}: {e}")

    def deliver(self) -> None:
        outbox, self._outbox = self._outbox, []
        for live, out in outbox:
            try:
                live.on_output(out)
            except Exception as e:  # the request's consumer failed: it can take no more output
                if not out.finished:
                    self.cancel(live.seq.request_id)
                print(
                    f"jfire: request {live.seq.request_id}'s output handler failed: {type(e).__name__}: {e}; "
                    "the request is cancelled",
                    file=sys.stderr,
                    flush=True,
                )

    # -- helpers -------------------------------------------------------------------------------

    def _output(
        self, live: LiveRequest, ids: list[int], text: str, logprobs, *, with_prompt_logprobs: bool = True
    ) -> RequestOutput:
        seq = live.seq
        return RequestOutput(
            seq.request_id,
            ids,
            text,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=seq.num_generated,
            prefix_hit_tokens=seq.prefix_hit_tokens,
            logprobs=[logprobs] if logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs_once(live) if with_prompt_logprobs else None,
        )

    def _prompt_logprobs_once(self, live: LiveRequest) -> list | None:
        if not live.seq.sampling.prompt_logprobs or live.prompt_logprobs_sent:
            return None
        live.prompt_logprobs_sent = True
        return live.prompt_logprobs


def output_text(live: LiveRequest, token: int, ends: bool, finish: str | None) -> tuple[str, str | None]:
    """(the new text to send for `token`, the finish reason): detokenized, cut at a stop string
    (which finishes the request), held back while it may be the start of one."""
    if live.decoder is None:
        return "", finish
    if ends:  # a stop token: its own text is not sent
        live.text += live.decoder.flush()  # type: ignore[attr-defined]
        delta, live.emitted = live.text[live.emitted :], len(live.text)
        return delta, finish
    live.text += live.decoder.push(token)  # type: ignore[attr-defined]
    if finish is not None:
        live.text += live.decoder.flush()  # type: ignore[attr-defined]
    stops = live.stops
    cut = stops.feed(live.text) if stops is not None else None
    if cut is not None:
        live.text, finish = live.text[:cut], "stop"
    safe = len(live.text) if finish or stops is None else len(live.text) - stops.held
    delta, live.emitted = live.text[live.emitted : safe], max(live.emitted, safe)
    return delta, finish
