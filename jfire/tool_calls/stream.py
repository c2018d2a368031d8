"""The state machine that reads every format: decoded text in, OpenAI tool-call events out;
and ToolCall, a whole call."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Protocol

from jfire.tool_calls.scan import _Cursor, _Mismatch, _NeedMore


class CallSyntax(Protocol):
    """What the state machine asks of a format (jfire.tool_calls.formats.ToolCallFormat)."""

    openers: tuple[str, ...]  # texts at which a block of calls may begin

    def head(self, c: _Cursor, first: bool) -> tuple[str, str | None]:
        """Read a call up to its arguments (from the block's opening when `first`):
        (function name, the call's id where the format writes one)."""
        ...

    def arguments(self, start: int):
        """The reader of a call's arguments starting at `start`."""
        ...

    def after_call(self, c: _Cursor) -> bool:
        """Read what follows a call's arguments: whether another call of the block follows."""
        ...


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI returns it
    id: str = dataclasses.field(default_factory=new_call_id)


class ToolCallStream:
    """Decoded text in, OpenAI streaming events out: {"content": ...} for text that is certainly
    content; {"index", "id", "type": "function", "function": {"name", "arguments": ""}} once a
    call's name is known, then {"index", "function": {"arguments": fragment}}. Text that may begin
    a call is held back until decided.

    With `eager` (streaming) a call is committed once its name is known; without (parse()) once it
    is complete, so that a malformed call can still go back to being content."""

    def __init__(self, fmt: CallSyntax, *, eager: bool = True):
        self._fmt, self._eager = fmt, eager
        self._text = ""
        self._step = self._content  # what reads the text next: _content, _head, _arguments or _tail
        self._content_from = 0  # the text before this went out as content or was dropped as framing
        self._search_from = 0  # where the next block may begin
        self._pos = 0  # where the current call's next piece begins
        self._undo_to = 0  # where the uncommitted part of the current block begins
        self._first = True  # the next head opens a block
        self._after_block = False  # nothing but whitespace since a block ended
        self._call_args = None  # the current call's arguments reader
        self._committed = False  # the current call's name went out
        self._calls = 0
        self._events: list[dict] = []
        self._pending: list[dict] = []  # the current call's events, while not committed

    def feed(self, delta: str) -> list[dict]:
        self._text += delta
        return self._run(final=False)

    def finish(self, *, cut: bool = False) -> list[dict]:
        """End of output: what was held back; an unterminated or malformed call is content.
        `cut`: the output was cut short (max_tokens), so a call whose name is known stays a call
        with the arguments as far as they were written (nothing added to close them, as OpenAI
        returns a call cut by max_tokens), and the rest of its block is framing, not content."""
        return self._run(final=True, cut=cut)

    def _run(self, final: bool, cut: bool = False) -> list[dict]:
        while True:
            try:
                if not self._step(final):
                    break
            except _NeedMore:
                break
            except _Mismatch:
                if cut and self._step in (self._arguments, self._tail):
                    self._keep_cut_call()
                else:
                    self._fail()
        events, self._events = self._events, []
        return events

    # -- the steps; each returns whether to go on --

    def _content(self, final: bool) -> bool:
        found = [i for o in self._fmt.openers if (i := self._text.find(o, self._search_from)) >= 0]
        if found:
            self._send_content(min(found), hold_space=True)
            self._step, self._pos = self._head, min(found)
            self._undo_to, self._first = self._pos, True
            return True
        held = 0 if final else self._partial_opener()
        self._search_from = max(self._search_from, len(self._text) - held)
        self._send_content(len(self._text) - held, hold_space=not final)
        return False

    def _head(self, final: bool) -> bool:
        c = _Cursor(self._text, self._pos, final)
        name, call_id = self._fmt.head(c, self._first)
        self._step, self._pos, self._call_args = self._arguments, c.pos, self._fmt.arguments(c.pos)
        self._emit(
            {
                "index": self._calls,
                "id": call_id or new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )
        self._committed = self._eager
        return True

    def _arguments(self, final: bool) -> bool:
        try:
            end = self._call_args.feed(self._text, final)
        finally:  # what was read before a _NeedMore or _Mismatch goes out too
            self._emit_arguments(self._call_args.take(self._text))
        if end is None:
            return False
        self._step, self._pos = self._tail, end
        return True

    def _tail(self, final: bool) -> bool:
        c = _Cursor(self._text, self._pos, final)
        another = self._fmt.after_call(c)
        self._events += self._pending
        self._pending, self._committed, self._calls = [], False, self._calls + 1
        self._pos = self._undo_to = self._content_from = c.pos
        self._first = not another
        if another:
            self._step = self._head
        else:
            self._step, self._search_from, self._after_block = self._content, c.pos, True
        return True

    def _keep_cut_call(self) -> None:
        """The output ended inside a call whose name is known: it stands as written so far."""
        self._events += self._pending
        self._pending, self._committed, self._calls = [], False, self._calls + 1
        self._content_from = self._search_from = len(self._text)
        self._step, self._after_block = self._content, True

    def _fail(self) -> None:
        if self._committed:
            # The name went out: the call ends here, and the text after what it took is content.
            closing, resume = self._call_args.abort() if self._step == self._arguments else ("", self._pos)
            self._emit_arguments(closing)
            self._committed, self._calls = False, self._calls + 1
            self._content_from = self._search_from = resume
        else:
            # The uncommitted call is content; read on from just past where it (or, for a block's
            # first call, its block) began.
            self._pending = []
            self._search_from = self._undo_to + 1
        self._step, self._after_block = self._content, False

    # -- output --

    def _emit(self, event: dict) -> None:
        events = self._events if self._eager else self._pending
        events.append(event)
        _merge_last(events)

    def _emit_arguments(self, fragment: str) -> None:
        if fragment:
            self._emit({"index": self._calls, "function": {"arguments": fragment}})

    def _send_content(self, upto: int, *, hold_space: bool) -> None:
        chunk = self._text[self._content_from : upto]
        if hold_space:
            chunk = chunk.rstrip()  # trailing whitespace may be framing before a call
        elif self._after_block and not chunk.strip():
            self._content_from, chunk = upto, ""  # whitespace ending the output after a call is framing
        if chunk:
            self._events.append({"content": chunk})
            _merge_last(self._events)
            self._after_block = False
        self._content_from += len(chunk)

    def _partial_opener(self) -> int:
        """The length of the longest end of the text that an opener begins with."""
        tail = self._text[self._search_from :]
        return max((k for o in self._fmt.openers for k in range(1, len(o)) if tail.endswith(o[:k])), default=0)


def _merge_last(events: list[dict]) -> None:
    """Fold the last event into the one before when both are content, or arguments of one call."""
    if len(events) < 2:
        return
    a, b = events[-2], events[-1]
    if "content" in a and "content" in b:
        a["content"] += b["content"]
    elif "index" in a and "index" in b and a["index"] == b["index"] and "id" not in a and "id" not in b:
        a["function"]["arguments"] += b["function"]["arguments"]
    else:
        return
    events.pop()
