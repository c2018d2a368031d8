"""What a caller holds of a request: its outputs as they arrive (`RequestOutput`), its end
result (`Completion`), and the handle to iterate, wait on or cancel it (`RequestHandle`)."""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from jfire.errors import JfireError

if TYPE_CHECKING:
    from jfire.client import EngineClient


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new ids since the last output
    text: str  # new text since the last output ("" without a tokenizer)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_hit_tokens: int = 0
    transfer: dict | None = None  # prefill role: where the decode side pulls this request's KV
    # With SamplingParams.logprobs, per token of token_ids: [logprob, [[id, logprob], ...]]
    logprobs: list | None = None
    # With SamplingParams.prompt_logprobs, on the first output: the same for prompt tokens 1..n-1
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, including an EOS that ended the sequence
    text: str | None  # None when the model has no tokenizer
    finish_reason: str
    ttft_s: float = 0.0
    latency_s: float = 0.0


class RequestHandle:
    """The caller's end of a request: iterate outputs as they arrive, or wait for the result."""

    def __init__(self, engine: EngineClient, request_id: str, prompt_ids: list[int], has_tokenizer: bool):
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._has_tokenizer = has_tokenizer
        self.submitted_at = time.perf_counter()

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.outputs.get()
            yield out
            if out.finished:
                return

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)

    def result(self) -> Completion:
        ids, text, first = [], [], None
        for out in self:
            if first is None and out.token_ids:
                first = time.perf_counter()
            ids += out.token_ids
            text.append(out.text)
            if out.finished and out.finish_reason == "error":
                raise JfireError(out.error or "request failed")
        end = time.perf_counter()
        return Completion(
            self.prompt_ids,
            ids,
            "".join(text) if self._has_tokenizer else None,
            out.finish_reason,
            ttft_s=(first or end) - self.submitted_at,
            latency_s=end - self.submitted_at,
        )
