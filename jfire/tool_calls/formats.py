"""The tool-call formats (hermes, llama3_json, llama4_pythonic, kimi_k2): how each reads a call,
renders past calls back into the prompt, and constrains calls with a Lark grammar."""

from __future__ import annotations

import json
import re

from jfire.tool_calls.scan import (
    _DIGITS,
    _JSON_NAME,
    _PY_NAME,
    _Cursor,
    _json_or_none,
    _JsonArguments,
    _Mismatch,
    _PythonArguments,
)
from jfire.tool_calls.stream import ToolCall, ToolCallStream


def _arguments_of(call: dict) -> dict:
    """An OpenAI tool call's arguments (JSON text, or already a mapping) as a dict; {} if they are
    not a JSON object, so that rendered prompts stay well-formed."""
    arguments = call["function"].get("arguments")
    value = _json_or_none(arguments) if isinstance(arguments, str) else arguments
    return value if isinstance(value, dict) else {}


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
    chosen = [
        (f["name"], f.get("parameters") or {"type": "object", "properties": {}})
        for f in functions
        if only is None or f["name"] == only
    ]
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

    def parse(self, text: str, *, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole completion; malformed calls stay in the content. `cut`:
        the completion was cut short (max_tokens), and a call it ends in whose name is known
        stays a call, its arguments as written so far (ToolCallStream.finish)."""
        stream = ToolCallStream(self, eager=False)
        content, calls = [], []
        for event in stream.feed(text) + stream.finish(cut=cut):
            if "content" in event:
                content.append(event["content"])
            elif "id" in event:
                calls.append(ToolCall(event["function"]["name"], "", event["id"]))
            else:
                calls[event["index"]].arguments += event["function"]["arguments"]
        return "".join(content), calls

    def stream_parser(self) -> ToolCallStream:
        return ToolCallStream(self)

    def grammar(
        self, tools: list[dict], *, only: str | None = None, parallel: bool = True, special_tokens: bool = False
    ) -> str:
        """A Lark grammar for llguidance whose sentences are one call (with `parallel`, one or more)
        of one of `tools` (or of the tool named `only`), its arguments satisfying the tool's
        schema. `special_tokens` writes <|...|> markers as special tokens, as llguidance needs when
        the tokenizer has them (Kimi K2's); otherwise they are text."""
        chosen = _chosen_tools(tools, only)
        rules = [
            rule
            for i, (name, params) in enumerate(chosen)
            for rule in self._call_rules(f"call_{i}", name, params, special_tokens)
        ]
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
        return (
            f'{{"name": {json.dumps(call["function"]["name"])}, '
            f'"{self.arguments_key}": {json.dumps(_arguments_of(call), ensure_ascii=False)}}}'
        )

    def _call_rules(self, rule, name, params, special_tokens):
        before, after = self.call_wrap
        prefix = f'{before}{{"name": {json.dumps(name)}, "{self.arguments_key}": '
        return [f"{rule}: {_lark(prefix)} {rule}_args {_lark('}' + after)}", f"{rule}_args: {_json_rule(params)}"]


class Hermes(_JsonObjectCalls):
    name = "hermes"
    openers = ("<tool_call>",)
    arguments_key = "arguments"
    call_wrap = ("<tool_call>\n", "\n</tool_call>")
    instructions = (
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

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
    instructions = (
        "To call functions, respond with only JSON objects in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}, '
        'separated by "; " when you call more than one. Do not use variables.'
    )

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
    instructions = (
        "If you decide to invoke any of the function(s), you MUST put it in the format of "
        "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
        "You SHOULD NOT include any other text in the response if you call a function"
    )

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
        rendered = (
            f"{call['function']['name']}("
            + ", ".join(f"{k}={_python_value(v)}" for k, v in _arguments_of(call).items())
            + ")"
            for call in calls
        )
        return "[" + ", ".join(rendered) + "]"

    def _frame(self, special_tokens):
        return _lark("["), _lark(", "), _lark("]")

    def _call_rules(self, rule, name, params, special_tokens):
        # Values are written as JSON (%json): JSON strings, numbers, lists and objects are Python
        # literals too, and the parser reads true/false/null. Keyword arguments come in the
        # schema's order, required ones always; only the schema's properties are offered.
        shared = {k: params[k] for k in ("$defs", "definitions") if k in params}
        properties = [(k, v) for k, v in (params.get("properties") or {}).items() if k.isidentifier()]
        rules = [
            f"{rule}_{i}: {_lark(k + '=')} {_json_rule({**(v if isinstance(v, dict) else {}), **shared})}"
            for i, (k, v) in enumerate(properties)
        ]
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
    instructions = (
        "To call functions, write one tool-call section holding every call:\n"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.<function-name>:<call-number>"
        "<|tool_call_argument_begin|><args-json-object><|tool_call_end|><|tool_calls_section_end|>\n"
        "with one <|tool_call_begin|>...<|tool_call_end|> per call, numbered from 0."
    )

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
            parts.append(
                f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>"
                f"{json.dumps(_arguments_of(call), ensure_ascii=False)}<|tool_call_end|>"
            )
        return "<|tool_calls_section_begin|>" + "".join(parts) + "<|tool_calls_section_end|>"

    def _frame(self, special_tokens):
        return (
            _marker("<|tool_calls_section_begin|>", special_tokens),
            "",
            _marker("<|tool_calls_section_end|>", special_tokens),
        )

    def _call_rules(self, rule, name, params, special_tokens):
        begin, arguments, end = (
            _marker(f"<|tool_call_{part}|>", special_tokens) for part in ("begin", "argument_begin", "end")
        )
        return [
            f"{rule}: {begin} {_lark(f'functions.{name}:')} /[0-9]{{1,9}}/ {arguments} {rule}_args {end}",
            f"{rule}_args: {_json_rule(params)}",
        ]


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Llama4Pythonic(), KimiK2())}
