"""OpenAI-style tool calls in the text formats model families were trained on.

A model calls tools by writing text in its family's format; the server turns that text into
OpenAI `tool_calls` (whole, or as streaming deltas), constrains it with a grammar when the
request demands a call, and renders past calls and tool results back into the prompt.

The formats, as the models write them:

- hermes (Hermes 2 Pro, Qwen 2.5, Qwen 3; the default, see below), one block per call, possibly
  after some text:
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
- llama3_json (Llama 3.1-3.3), optionally after `<|python_tag|>`, calls separated by "; ":
      {"name": "get_weather", "parameters": {"city": "Paris"}}
- llama4_pythonic (Llama 4; Gemma 3's prompt asks for the same), a Python list of calls whose
  arguments are Python literals, optionally wrapped in `<|python_start|>...<|python_end|>`:
      [get_weather(city="Paris"), get_time(tz="UTC")]
- kimi_k2 (Kimi K2 / K2.5), special tokens around the calls, each call's id naming its function
  (one line in the output):
      <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
      <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Text outside calls is content. Whitespace before a call, between calls, and after the last call
at the end of the output is framing, not content. A call that is malformed (bad JSON, unknown
structure, unterminated) stays in the content verbatim. JSON formats must write "name" first,
as the models do: that is what lets the name stream before the arguments.

The default is hermes: the default model (SmolLM2) has no tool support in its chat template, so
`prepare_messages` describes the tools in the system prompt (`default_tool_prompt`, worded like
Hermes' and Qwen's own) and asks for <tool_call> blocks, the format most open models learned.

One state machine (`ToolCallStream`) reads every format: a format only says at which texts a
block of calls may begin (`openers`), how a call starts (`head`), how its arguments are read, and
what may follow a call (`after_call`). `parse` runs the machine over the whole text and takes a
call only once it is complete. Streaming commits a call as soon as its name is known (when OpenAI
clients expect it); a call that turns out malformed after that stays a call, with the arguments
sent so far, where `parse` would keep it as content. On well-formed output the two agree however
the text is split.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI returns it
    id: str = dataclasses.field(default_factory=new_call_id)


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
        rest = self.text[self.pos:]
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
        if end is not None and not isinstance(_json_or_none(text[self.start:end]), dict):
            raise _Mismatch
        return end

    def take(self, text: str) -> str:
        """The arguments JSON read since the last take."""
        fragment, self.sent = text[self.sent:self.scanner.at], self.scanner.at
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
            value = _python_literal(text[self.value_start:end])
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
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) in (int, float):
        return -node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name) and node.id in _JSON_LITERALS:
        return _JSON_LITERALS[node.id]
    raise ValueError("not a literal")


def _arguments_of(call: dict) -> dict:
    """An OpenAI tool call's arguments (JSON text, or already a mapping) as a dict; {} if they are
    not a JSON object, so that rendered prompts stay well-formed."""
    arguments = call["function"].get("arguments")
    value = _json_or_none(arguments) if isinstance(arguments, str) else arguments
    return value if isinstance(value, dict) else {}


# ---- the formats ---------------------------------------------------------------------------------

# The argument JSON the grammars allow, spaced as json.dumps (and so the models' training data)
# spaces it; `lenient`: a schema keyword llguidance lacks is ignored rather than failing the request.
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}


def _lark(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


def _marker(text: str, special_tokens: bool) -> str:
    return text if special_tokens else _lark(text)  # bare <|...|> is a special token in llguidance's Lark


def _json_rule(schema) -> str:
    return "%json " + json.dumps({**(schema if isinstance(schema, dict) else {}), "x-guidance": _JSON_STYLE})


def _chosen_tools(tools: list[dict], only: str | None) -> list[tuple[str, dict]]:
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    chosen = [(f["name"], f.get("parameters") or {"type": "object", "properties": {}})
              for f in functions if only is None or f["name"] == only]
    if not chosen:
        raise ValueError(f"no tool named {only!r} among the request's tools" if only else "no tools to call")
    return chosen


class ToolCallFormat:
    name: str
    openers: tuple[str, ...]  # texts at which a block of calls may begin
    instructions: str  # how to call, for the default tool prompt

    # -- what the state machine asks of a format --

    def head(self, c: _Cursor, first: bool) -> tuple[str, str | None]:
        """Read a call up to its arguments (from the block's opening when `first`):
        (function name, the call's id where the format writes one)."""
        raise NotImplementedError

    def arguments(self, start: int):
        return _JsonArguments(start)

    def after_call(self, c: _Cursor) -> bool:
        """Read what follows a call's arguments: whether another call of the block follows."""
        raise NotImplementedError

    # -- public --

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole completion; malformed calls stay in the content."""
        stream = ToolCallStream(self, eager=False)
        content, calls = [], []
        for event in stream.feed(text) + stream.finish():
            if "content" in event:
                content.append(event["content"])
            elif "id" in event:
                calls.append(ToolCall(event["function"]["name"], "", event["id"]))
            else:
                calls[event["index"]].arguments += event["function"]["arguments"]
        return "".join(content), calls

    def stream_parser(self) -> ToolCallStream:
        return ToolCallStream(self)

    def grammar(self, tools: list[dict], *, only: str | None = None, parallel: bool = True,
                special_tokens: bool = False) -> str:
        """A Lark grammar for llguidance whose sentences are one call (with `parallel`, one or more)
        of one of `tools` (or of the tool named `only`), its arguments satisfying the tool's
        schema. `special_tokens` writes <|...|> markers as special tokens, as llguidance needs when
        the tokenizer has them (Kimi K2's); otherwise they are text."""
        chosen = _chosen_tools(tools, only)
        rules = [rule for i, (name, params) in enumerate(chosen)
                 for rule in self._call_rules(f"call_{i}", name, params, special_tokens)]
        begin, separator, end = self._frame(special_tokens)
        calls = f"call ({separator} call)*" if parallel and separator else "call+" if parallel else "call"
        start = " ".join(part for part in (begin, calls, end) if part)
        return "\n".join([f"start: {start}", "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))), *rules])

    def render_calls(self, calls: list[dict]) -> str:
        """The text that an assistant message's OpenAI `tool_calls` stand for in this format."""
        raise NotImplementedError

    # -- grammar parts --

    def _frame(self, special_tokens: bool) -> tuple[str, str, str]:
        """Lark for what comes before the calls, between them, and after them."""
        raise NotImplementedError

    def _call_rules(self, rule: str, name: str, params: dict, special_tokens: bool) -> list[str]:
        """Lark rules, the first named `rule`, for one call of the tool."""
        raise NotImplementedError


class _JsonObjectCalls(ToolCallFormat):
    """Calls as {"name": ..., "<arguments_key>": {...}}, each wrapped in `call_wrap`."""

    arguments_key: str
    call_wrap = ("", "")

    def _json_head(self, c: _Cursor) -> str:
        c.expect("{", '"name"', ":", '"')
        name = c.token(_JSON_NAME)
        c.expect('"', ",")
        c.ws()
        if not (c.opt('"arguments"') or c.opt('"parameters"')):  # whichever the model was taught
            raise _Mismatch
        c.expect(":")
        c.peek("{")  # commit to a call only once its arguments are sure to be an object
        return name

    def _call_text(self, call: dict) -> str:
        return (f'{{"name": {json.dumps(call["function"]["name"])}, '
                f'"{self.arguments_key}": {json.dumps(_arguments_of(call), ensure_ascii=False)}}}')

    def _call_rules(self, rule, name, params, special_tokens):
        before, after = self.call_wrap
        prefix = f'{before}{{"name": {json.dumps(name)}, "{self.arguments_key}": '
        return [f"{rule}: {_lark(prefix)} {rule}_args {_lark('}' + after)}", f"{rule}_args: {_json_rule(params)}"]


class Hermes(_JsonObjectCalls):
    name = "hermes"
    openers = ("<tool_call>",)
    arguments_key = "arguments"
    call_wrap = ("<tool_call>\n", "\n</tool_call>")
    instructions = ("For each function call, return a json object with function name and arguments within "
                    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def head(self, c, first):
        c.expect("<tool_call>")
        return self._json_head(c), None

    def after_call(self, c):
        c.expect("}", "</tool_call>")
        return False  # one call per block; the next call opens its own

    def render_calls(self, calls):
        return "\n".join(f"<tool_call>\n{self._call_text(call)}\n</tool_call>" for call in calls)

    def _frame(self, special_tokens):
        return "", _lark("\n"), ""


class Llama3Json(_JsonObjectCalls):
    name = "llama3_json"
    openers = ("<|python_tag|>", "{")
    arguments_key = "parameters"
    instructions = ("To call functions, respond with only JSON objects in the format "
                    '{"name": function name, "parameters": dictionary of argument name and its value}, '
                    'separated by "; " when you call more than one. Do not use variables.')

    def head(self, c, first):
        if first:
            c.opt("<|python_tag|>")
        return self._json_head(c), None

    def after_call(self, c):
        c.expect("}")
        end = c.pos
        c.ws()
        if c.opt(";"):
            return True
        c.pos = end  # the block ends with the object; what follows is content
        return False

    def render_calls(self, calls):
        return "; ".join(map(self._call_text, calls))

    def _frame(self, special_tokens):
        return "", _lark("; "), ""


class Llama4Pythonic(ToolCallFormat):
    name = "llama4_pythonic"
    openers = ("<|python_start|>", "[")
    instructions = ("If you decide to invoke any of the function(s), you MUST put it in the format of "
                    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
                    "You SHOULD NOT include any other text in the response if you call a function")

    def head(self, c, first):
        if first:
            c.opt("<|python_start|>")
            c.expect("[")
        c.ws()
        name = c.token(_PY_NAME)
        c.expect("(")
        arguments = c.pos
        c.ws()  # commit only to what reads as a call: `name()` or `name(keyword=`
        if not c.opt(")"):
            c.token(_PY_NAME)
            c.expect("=")
        c.pos = arguments
        return name, None

    def arguments(self, start):
        return _PythonArguments(start)

    def after_call(self, c):
        c.ws()
        if c.opt(","):
            return True
        c.expect("]")
        c.opt("<|python_end|>")
        return False

    def render_calls(self, calls):
        rendered = (f"{call['function']['name']}("
                    + ", ".join(f"{k}={_python_value(v)}" for k, v in _arguments_of(call).items()) + ")"
                    for call in calls)
        return "[" + ", ".join(rendered) + "]"

    def _frame(self, special_tokens):
        return _lark("["), _lark(", "), _lark("]")

    def _call_rules(self, rule, name, params, special_tokens):
        # Values are written as JSON (%json): JSON strings, numbers, lists and objects are Python
        # literals too, and the parser reads true/false/null. Keyword arguments come in the
        # schema's order, required ones always; only the schema's properties are offered.
        shared = {k: params[k] for k in ("$defs", "definitions") if k in params}
        properties = [(k, v) for k, v in (params.get("properties") or {}).items() if k.isidentifier()]
        rules = [f"{rule}_{i}: {_lark(k + '=')} {_json_rule({**(v if isinstance(v, dict) else {}), **shared})}"
                 for i, (k, v) in enumerate(properties)]
        required = set(params.get("required", []))
        kwargs = _kwargs_expression([(f"{rule}_{i}", k in required) for i, (k, _) in enumerate(properties)])
        return [" ".join(filter(None, [f"{rule}:", _lark(name + "("), kwargs, _lark(")")])), *rules]


def _python_value(value) -> str:
    """A JSON value as a Python literal, strings double-quoted as Llama 4's docs write them."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_python_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_python_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)  # a JSON string or number is a Python literal


def _kwargs_expression(items: list[tuple[str, bool]]) -> str:
    """Lark for the rules `items` in order, ", "-separated, the ones not required optional."""
    def after_one(i):  # items i.. once an earlier one was written
        if i == len(items):
            return ""
        rule, required = items[i]
        return (f'", " {rule} ' if required else f'(", " {rule})? ') + after_one(i + 1)

    def first(i):  # items i.. with none written yet
        if i == len(items):
            return ""
        rule, required = items[i]
        if required:
            return f"{rule} {after_one(i + 1)}"
        rest = first(i + 1)
        return f"({rule} {after_one(i + 1)}| {rest})" if rest else f"({rule} {after_one(i + 1)})?"

    return first(0).strip()


class KimiK2(ToolCallFormat):
    name = "kimi_k2"
    openers = ("<|tool_calls_section_begin|>",)
    instructions = ("To call functions, write one tool-call section holding every call:\n"
                    "<|tool_calls_section_begin|><|tool_call_begin|>functions.<function-name>:<call-number>"
                    "<|tool_call_argument_begin|><args-json-object><|tool_call_end|><|tool_calls_section_end|>\n"
                    "with one <|tool_call_begin|>...<|tool_call_end|> per call, numbered from 0.")

    def head(self, c, first):
        if first:
            c.expect("<|tool_calls_section_begin|>")
        c.expect("<|tool_call_begin|>", "functions.")
        name = c.token(_JSON_NAME)  # the id is functions.<name>:<number>
        c.expect(":")
        number = c.token(_DIGITS)
        c.expect("<|tool_call_argument_begin|>")
        c.peek("{")
        return name, f"functions.{name}:{number}"

    def after_call(self, c):
        c.expect("<|tool_call_end|>")
        c.ws()
        if c.starts("<|tool_call_begin|>"):
            return True
        c.expect("<|tool_calls_section_end|>")
        return False

    def render_calls(self, calls):
        parts = []
        for i, call in enumerate(calls):
            call_id = call.get("id") or ""
            if not re.fullmatch(r"functions\.[\w.\-]+:\d+", call_id):
                call_id = f"functions.{call['function']['name']}:{i}"
            parts.append(f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>"
                         f"{json.dumps(_arguments_of(call), ensure_ascii=False)}<|tool_call_end|>")
        return "<|tool_calls_section_begin|>" + "".join(parts) + "<|tool_calls_section_end|>"

    def _frame(self, special_tokens):
        return (_marker("<|tool_calls_section_begin|>", special_tokens), "",
                _marker("<|tool_calls_section_end|>", special_tokens))

    def _call_rules(self, rule, name, params, special_tokens):
        begin, arguments, end = (_marker(f"<|tool_call_{part}|>", special_tokens)
                                 for part in ("begin", "argument_begin", "end"))
        return [f"{rule}: {begin} {_lark(f'functions.{name}:')} /[0-9]{{1,9}}/ {arguments} {rule}_args {end}",
                f"{rule}_args: {_json_rule(params)}"]


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Llama4Pythonic(), KimiK2())}


# ---- the state machine ---------------------------------------------------------------------------

class ToolCallStream:
    """Decoded text in, OpenAI streaming events out: {"content": ...} for text that is certainly
    content; {"index", "id", "type": "function", "function": {"name", "arguments": ""}} once a
    call's name is known, then {"index", "function": {"arguments": fragment}}. Text that may begin
    a call is held back until decided.

    With `eager` (streaming) a call is committed once its name is known; without (parse()) once it
    is complete, so that a malformed call can still go back to being content."""

    def __init__(self, fmt: ToolCallFormat, *, eager: bool = True):
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

    def finish(self) -> list[dict]:
        """End of output: what was held back; an unterminated or malformed call is content."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[dict]:
        while True:
            try:
                if not self._step(final):
                    break
            except _NeedMore:
                break
            except _Mismatch:
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
        self._emit({"index": self._calls, "id": call_id or new_call_id(), "type": "function",
                    "function": {"name": name, "arguments": ""}})
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
        chunk = self._text[self._content_from:upto]
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
        tail = self._text[self._search_from:]
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


# ---- choosing a format, rendering prompts --------------------------------------------------------

_FORMAT_BY_MODEL_TYPE = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                         "llama": "llama3_json", "llama4": "llama4_pythonic", "llama4_text": "llama4_pythonic",
                         "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2"}


def format_for(chat_template: str | None, model_type: str | None = None) -> ToolCallFormat:
    """The format the model calls tools in: from markers in its chat template, else from its
    model type, else hermes (which default_tool_prompt teaches templates without tool support)."""
    template = chat_template or ""
    if "<|tool_calls_section_begin|>" in template:
        return FORMATS["kimi_k2"]
    if "<|python_start|>" in template or "[func_name1(" in template:  # Llama 4's pythonic instructions
        return FORMATS["llama4_pythonic"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FORMATS["llama3_json"]
    return FORMATS[_FORMAT_BY_MODEL_TYPE.get(model_type or "", "hermes")]


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the template renders `tools` itself."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def default_tool_prompt(tools: list[dict], fmt: ToolCallFormat) -> str:
    """System-prompt text listing the tools and how to call them, for templates without tool
    support (worded like Hermes' and Qwen's own tool prompt)."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
            f"</tools>\n\n{fmt.instructions}")


def prepare_messages(messages: list[dict], tools: list[dict] | None, chat_template: str | None,
                     fmt: ToolCallFormat) -> list[dict]:
    """OpenAI chat messages made renderable by the chat template.

    A template with tool support gets them as they are, except that tool calls' `arguments` JSON
    text is also given parsed (HF templates iterate over it as a mapping). One without gets:
    - the tool prompt at the end of the system message (a system message is added if none);
    - each assistant message's tool calls appended to its content as text (render_calls);
    - each run of tool results as one message, each result in <tool_response>...</tool_response>
      as Hermes' template writes them, with role "tool" (templates that print any role, like the
      default model's, show it as such) or, for a template that raises on roles it does not
      know (it calls raise_exception), role "user";
    - content None as "", so that the template prints nothing for it.
    """
    if template_takes_tools(chat_template):
        return [_with_parsed_arguments(m) for m in messages]
    results_role = "user" if "raise_exception" in (chat_template or "") else "tool"
    out: list[dict] = []
    for message in messages:
        if message.get("role") == "tool":
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("role") == results_role and out[-1]["content"].endswith("</tool_response>"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": results_role, "content": response})
            continue
        rendered = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if message.get("tool_calls"):
            text, calls = _text(message.get("content")), fmt.render_calls(message["tool_calls"])
            rendered["content"] = f"{text}\n{calls}" if text else calls
        elif rendered.get("content") is None:
            rendered["content"] = ""
        out.append(rendered)
    if tools:
        prompt = default_tool_prompt(tools, fmt)
        if out and out[0].get("role") == "system":
            system = _text(out[0]["content"])
            out[0] = {**out[0], "content": f"{system}\n\n{prompt}" if system else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _text(content) -> str:
    """A message's content as text: None is empty, text parts are joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _with_parsed_arguments(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call.get("function", {}).get("arguments")
        parsed = _json_or_none(arguments) if isinstance(arguments, str) else None
        if isinstance(parsed, dict):
            call = {**call, "function": {**call["function"], "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}
