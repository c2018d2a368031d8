"""A request's engine outputs turned into OpenAI responses: one JSON body, or SSE chunks.

A request with n choices runs as n engine requests whose outputs arrive on one queue; each
choice keeps its own text, logprobs and tool-call parser. The client is checked for a
disconnect every DISCONNECT_CHECK_S whether or not outputs are flowing (a non-streaming
response writes nothing until the end), and leaving cancels every unfinished choice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from jfire.client import EngineClient
from jfire.requests import RequestOutput
from serve.chat import OutputPlan

DISCONNECT_CHECK_S = 0.25


class Choice:
    """One choice's accumulated output."""

    def __init__(self, index: int, request_id: str, plan: OutputPlan, echo: str = ""):
        self.index, self.request_id = index, request_id
        self.echo, self.echo_pending = echo, bool(echo)  # completions' echo: the prompt comes first
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # [logprob, [[id, logprob], ...]] per token
        self.prompt_logprobs: list | None = None  # the same for prompt tokens 1..n-1 (echo)
        self.last: RequestOutput | None = None
        self.tool_stream = plan.tool_format.stream_parser() if plan.tool_format else None
        self.called = False  # a tool call was streamed

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out


class Responder:
    def __init__(
        self,
        state,
        request,
        engine: EngineClient,
        request_id: str,
        choice_ids: list[str],
        outputs: asyncio.Queue,
        model: str,
        chat: bool,
        plan: OutputPlan,
        *,
        logprobs: int | None,
        echo: str = "",
        prompt_ids: list[int] = (),
        token_ids: bool = False,
    ):
        self.state, self.request, self.engine = state, request, engine
        self.request_id, self.outputs, self.model, self.chat, self.plan = request_id, outputs, model, chat, plan
        self.choices = {rid: Choice(i, rid, plan, echo) for i, rid in enumerate(choice_ids)}
        self.logprobs = logprobs
        self.prompt_ids = list(prompt_ids)
        self.token_ids = token_ids  # return the token ids beside the text (return_token_ids)
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last_check = self.start

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices.values())

    async def _next(self) -> tuple[Choice, RequestOutput] | None:
        """The next output and its choice, or None if the client went away."""
        while True:
            now = time.perf_counter()
            if now - self.last_check >= DISCONNECT_CHECK_S:
                self.last_check = now
                if await self.request.is_disconnected():
                    return None
            try:
                out = await asyncio.wait_for(self.outputs.get(), timeout=0.25)
            except TimeoutError:
                if await self.request.is_disconnected():
                    return None
                continue
            choice = self.choices[out.request_id]
            choice.add(out)
            if out.token_ids and self.first is None:
                self.first = time.perf_counter()
                self.state.metrics.ttft.observe(self.first - self.start)
            if out.finished and self.first is not None and out.completion_tokens > 1:
                self.state.metrics.tpot.observe((time.perf_counter() - self.first) / (out.completion_tokens - 1))
            return choice, out

    def access_fields(self) -> dict:
        """What the access log says of this request (serve/access_log.py)."""
        usage = self._usage()
        finish = ",".join(sorted({c.last.finish_reason if c.finished else "cancelled" for c in self.choices.values()}))
        fields = {
            "prompt_tokens": usage["prompt_tokens"] or len(self.prompt_ids),
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "finish": finish,
        }
        if self.first is not None:
            fields["ttft"] = f"{self.first - self.start:.3f}s"
        return {**fields, "id": self.request_id}

    def cancel_unfinished(self) -> None:
        for choice in self.choices.values():
            if not choice.finished:
                self.engine.cancel(choice.request_id)

    def _usage(self) -> dict:
        lasts = [c.last for c in self.choices.values() if c.last is not None]
        prompt = lasts[0].prompt_tokens if lasts else 0
        completion = sum(o.completion_tokens for o in lasts)
        cached = lasts[0].prefix_hit_tokens if lasts else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- logprobs in OpenAI's two shapes ------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id) if self.tokenizer else str(token_id).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, token_ids: list[int], entries: list) -> dict | None:
        if self.logprobs is None:
            return None
        content = []
        for token_id, (logprob, top) in zip(token_ids, entries):
            text, raw = self._token(token_id)
            tops = []
            for i, lp in top[: self.logprobs]:
                t, b = self._token(i)
                tops.append({"token": t, "logprob": lp, "bytes": b})
            content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": tops})
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, token_ids: list[int], entries: list, offset: int) -> dict | None:
        """Completions' shape; an entry None (the prompt's first token, echoed) has none."""
        if self.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text, _ = self._token(token_id)
            tokens.append(text)
            token_logprobs.append(entry[0] if entry else None)
            tops.append({self._token(i)[0]: lp for i, lp in entry[1][: self.logprobs]} if entry else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _with_echo(self, c: Choice, text: str, token_ids: list[int], entries: list) -> tuple[str, list, list]:
        """The prompt before a choice's first text (completions' echo), its tokens' logprobs
        before the first entries."""
        if not c.echo_pending:
            return text, token_ids, entries
        c.echo_pending = False
        if self.logprobs is None:
            return c.echo + text, token_ids, entries
        prompt_entries = [None, *(c.prompt_logprobs or [])]
        return c.echo + text, self.prompt_ids + token_ids, prompt_entries + entries

    # -- one response ---------------------------------------------------------------------------

    async def whole(self) -> dict | None:
        """The response body, or None if the client went away."""
        try:
            while not self.finished:
                if await self._next() is None:
                    return None
        finally:
            self.cancel_unfinished()
        errors = [c.last for c in self.choices.values() if c.last.finish_reason == "error"]
        if errors:
            return {"error": errors[0].error or "generation failed"}
        choices = [self._whole_choice(c) for c in self.choices.values()]
        body: dict[str, object] = {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }
        if self.token_ids:
            body["prompt_token_ids"] = self.prompt_ids
            for choice, c in zip(choices, self.choices.values()):
                choice["token_ids"] = c.token_ids
        return body

    def _whole_choice(self, c: Choice) -> dict:
        text, finish = "".join(c.text), c.last.finish_reason
        if not self.chat:
            text, token_ids, entries = self._with_echo(c, text, c.token_ids, c.logprobs)
            return {
                "index": c.index,
                "text": text,
                "finish_reason": finish,
                "logprobs": self._completion_logprobs(token_ids, entries, 0),
            }
        message = {"role": "assistant", "content": text}
        if self.plan.tool_format is not None:
            content, calls = self.plan.tool_format.parse(text, cut=finish == "length")
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [
                    {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                    for call in calls
                ]
                finish = "tool_calls" if finish == "stop" else finish
        return {
            "index": c.index,
            "message": message,
            "finish_reason": finish,
            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs),
        }

    # -- a stream -------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _deltas(self, c: Choice, out: RequestOutput) -> list[dict]:
        """The chunk choices one output makes: text (or tool-call) deltas, and the end; the
        first of them carries the output's token ids when they were asked for."""
        chunks = self._delta_chunks(c, out)
        if self.token_ids and out.token_ids:
            if not chunks:
                chunks.append(
                    {
                        "index": c.index,
                        **({"delta": {}} if self.chat else {"text": ""}),
                        "finish_reason": None,
                        "logprobs": None,
                    }
                )
            chunks[0]["token_ids"] = out.token_ids
        return chunks

    def _delta_chunks(self, c: Choice, out: RequestOutput) -> list[dict]:
        finish = out.finish_reason if out.finished else None
        entries = out.logprobs or []
        if not self.chat:
            offset = sum(len(t) for t in c.text) - len(out.text) + (len(c.echo) if not c.echo_pending else 0)
            text, token_ids, entries = self._with_echo(c, out.text, out.token_ids, entries)
            if not (text or out.finished or entries):
                return []
            return [
                {
                    "index": c.index,
                    "text": text,
                    "finish_reason": finish,
                    "logprobs": self._completion_logprobs(token_ids, entries, offset),
                }
            ]
        deltas: list[dict] = []
        if c.tool_stream is None:
            if out.text:
                deltas.append({"content": out.text})
        else:
            events = c.tool_stream.feed(out.text) if out.text else []
            if out.finished:
                events += c.tool_stream.finish(cut=out.finish_reason == "length")
            c.called |= any("content" not in e for e in events)
            deltas += [e if "content" in e else {"tool_calls": [e]} for e in events]
            if finish == "stop" and c.called:
                finish = "tool_calls"
        logprobs = self._chat_logprobs(out.token_ids, entries) if entries else None
        chunks = [{"index": c.index, "delta": d, "finish_reason": None, "logprobs": None} for d in deltas]
        if logprobs is not None:
            if not chunks:
                chunks.append({"index": c.index, "delta": {}, "finish_reason": None, "logprobs": None})
            chunks[0]["logprobs"] = logprobs
        if out.finished:
            chunks.append({"index": c.index, "delta": {}, "finish_reason": finish, "logprobs": None})
        return chunks

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        def event(payload) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        prompt_ids = {"prompt_token_ids": self.prompt_ids} if self.token_ids else {}
        try:
            if self.chat:
                yield event(
                    self._chunk(
                        [
                            {"index": c.index, "delta": {"role": "assistant"}, "finish_reason": None, "logprobs": None}
                            for c in self.choices.values()
                        ]
                    )
                    | prompt_ids
                )
                prompt_ids = {}
            while not self.finished:
                got = await self._next()
                if got is None:
                    return
                c, out = got
                if out.finished and out.finish_reason == "error":
                    yield event({"error": {"message": out.error, "type": "server_error", "param": None, "code": None}})
                    yield "data: [DONE]\n\n"  # the stream still ends as streams end
                    return
                for choice in self._deltas(c, out):
                    yield event(self._chunk([choice]) | prompt_ids)
                    prompt_ids = {}
            if include_usage:
                chunk = self._chunk([])
                chunk["usage"] = self._usage()
                yield event(chunk)
            yield "data: [DONE]\n\n"
        finally:
            # Runs on normal completion and when the client disconnects (the generator is closed).
            self.cancel_unfinished()
