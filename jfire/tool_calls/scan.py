"""Reading tool-call text that arrives in pieces: a cursor over a format's framing that tells
"not yet" from "never", scanners that find where JSON and Python arguments end, and Python
literals converted to JSON."""

from __future__ import annotations

import ast
import json
import re

# ---- reading framing: "not yet" versus "never" ---------------------------------------------------


class _NeedMore(Exception):
    """The text so far could still go either way."""


class _Mismatch(Exception):
    """The text is not what the format expects here."""


class _Cursor:
    """Reads `text` from `pos`; until `final`, running out of text raises _NeedMore."""

    def __init__(self, text: str, pos: int, final: bool):
        self.text, self.pos, self.final = text, pos, final

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def starts(self, literal: str) -> bool:
        """Whether `literal` comes next (left unread)."""
        if self.text.startswith(literal, self.pos):
            return True
        rest = self.text[self.pos :]
        if not self.final and len(rest) < len(literal) and literal.startswith(rest):
            raise _NeedMore
        return False

    def opt(self, literal: str) -> bool:
        if self.starts(literal):
            self.pos += len(literal)
            return True
        return False

    def expect(self, *literals: str) -> None:
        """Each literal in turn, whitespace allowed before each."""
        for literal in literals:
            self.ws()
            if not self.opt(literal):
                raise _Mismatch

    def peek(self, literal: str) -> None:
        """After whitespace, `literal` must come next (left unread)."""
        self.ws()
        if not self.starts(literal):
            raise _Mismatch

    def token(self, pattern: re.Pattern) -> str:
        """A run of characters matching `pattern` (a character class with a quantifier)."""
        m = pattern.match(self.text, self.pos)
        reaches_end = self.pos == len(self.text) if m is None else m.end() == len(self.text)
        if reaches_end and not self.final:
            raise _NeedMore  # the run may go on
        if m is None:
            raise _Mismatch
        self.pos = m.end()
        return m.group()


_JSON_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function names (dotted ones too)
_PY_NAME = re.compile(r"[A-Za-z_]\w{0,63}")
_DIGITS = re.compile(r"\d{1,9}")


# ---- arguments -----------------------------------------------------------------------------------


class _Scanner:
    """Finds where a value ends in text that arrives in pieces, resuming where it stopped (so a
    long argument is read once, not once per token). `ends` are the characters that end it at
    depth 0 (none for a JSON object, which ends with its closing brace)."""

    def __init__(self, start: int, quotes: str, ends: str):
        self.at, self.depth, self.quote = start, 0, ""
        self.quotes, self.ends = quotes, ends
        self._special = re.compile("[" + re.escape("()[]{}\\" + quotes + ends) + "]")

    def end(self, text: str) -> int | None:
        """Index of the ending character, or just past the closing brace; None while it goes on."""
        i = self.at
        while (m := self._special.search(text, i)) is not None:
            j, ch = m.start(), m.group()
            i = j + (2 if ch == "\\" else 1)
            if ch == "\\":
                if i > len(text):
                    i = j  # the escaped character has not arrived
                    break
            elif self.quote:
                self.quote = "" if ch == self.quote else self.quote
            elif ch in self.quotes:
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}" and self.depth > 0:
                self.depth -= 1
                if self.depth == 0 and not self.ends:
                    self.at = i
                    return i
            elif self.depth == 0 and ch in self.ends:
                self.at = j
                return j
            elif ch in ")]}":
                raise _Mismatch  # a bracket closing nothing
        else:
            i = len(text)
        self.at = i
        return None


class _JsonArguments:
    """A JSON object, streamed as it arrives: its text is the arguments text, unchanged."""

    def __init__(self, start: int):
        self.start = self.sent = start
        self.scanner = _Scanner(start, '"', "")

    def feed(self, text: str, final: bool) -> int | None:
        """The end of the arguments in `text`, or None while they go on."""
        if not text.startswith("{", self.start):
            raise _NeedMore if self.start == len(text) and not final else _Mismatch
        end = self.scanner.end(text)
        if end is None and final:
            raise _Mismatch  # unterminated
        if end is not None and not isinstance(_json_or_none(text[self.start : end]), dict):
            raise _Mismatch
        return end

    def take(self, text: str) -> str:
        """The arguments JSON read since the last take."""
        fragment, self.sent = text[self.sent : self.scanner.at], self.scanner.at
        return fragment

    def abort(self) -> tuple[str, int]:
        """(JSON to close what was sent, where the text not taken begins). What was sent stands,
        as OpenAI sends arguments cut short by max_tokens."""
        return "", self.sent


class _PythonArguments:
    """Keyword arguments `k=<Python literal>, ...)`, sent as JSON one whole argument at a time."""

    def __init__(self, start: int):
        self.pos = start  # start of the next keyword argument, or of the closing parenthesis
        self.key: str | None = None  # the argument whose value is being read
        self.value_start, self.scanner = start, None
        self.count, self.out = 0, ""  # arguments read, JSON not yet taken

    def feed(self, text: str, final: bool) -> int | None:
        while True:
            if self.key is None:
                c = _Cursor(text, self.pos, final)
                c.ws()
                if c.opt(")"):
                    self.out += "}" if self.count else "{}"
                    self.pos = c.pos
                    return c.pos
                self.key = c.token(_PY_NAME)
                c.expect("=")
                c.ws()
                self.value_start = c.pos
                self.scanner = _Scanner(c.pos, "'\"", ",)")
            end = self.scanner.end(text)
            if end is None:
                if final:
                    raise _Mismatch
                return None
            value = _python_literal(text[self.value_start : end])
            self.out += f"{', ' if self.count else '{'}{json.dumps(self.key)}: {value}"
            self.count, self.key = self.count + 1, None
            self.pos = end + (text[end] == ",")  # a closing ")" is read by the next round

    def take(self, text: str) -> str:
        fragment, self.out = self.out, ""
        return fragment

    def abort(self) -> tuple[str, int]:
        return ("}" if self.count else "{}"), self.pos  # what was sent stays a JSON object


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _python_literal(source: str) -> str:
    """JSON text of a Python literal, read with `ast`, never evaluated. JSON's true/false/null are
    read too, since grammar() writes argument values as JSON."""
    try:
        return json.dumps(_literal(ast.parse(source.strip(), mode="eval").body), ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _Mismatch from None


_JSON_LITERALS = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return -node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name) and node.id in _JSON_LITERALS:
        return _JSON_LITERALS[node.id]
    raise ValueError("not a literal")
