"""The tool-call formats (hermes, llama3_json, llama4_pythonic, kimi_k2): how each reads a call,
renders past calls back into the prompt, and constrains calls with a Lark grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

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
# spaces it. Not lenient: a schema keyword llguidance cannot enforce fails the grammar, and the
# server refuses the request naming it (jfire.grammar.check_json_schema), as for response_format.
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# The arguments of a call whose tool is not `strict`, where a grammar frames the call anyway.
ANY_ARGUMENTS: dict = {"type": "object"}


def _lark(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


# The special tokens a format's markers are, by their text: {marker: token id}. A marker that is
# one becomes that token in a grammar (llguidance's <[id]>), the token the model was trained to
# emit; otherwise it is text.
NO_SPECIAL: Mapping[str, int] = {}


def _marker(text: str, special: Mapping[str, int]) -> str:
    return f"<[{special[text]}]>" if text in special else _lark(text)


def _json_rule(schema) -> str:
    return "%json " + json.dumps({**(schema if isinstance(schema, dict) else {}), "x-guidance": _JSON_STYLE})


def _chosen_tools(tools: list[dict], only: str | None, *, strict_only: bool = False) -> list[tuple[str, dict]]:
    """(name, schema of its arguments) of the tools a grammar offers. `strict_only`: the
    schema only of tools marked `strict`, the others taking any arguments (ANY_ARGUMENTS)."""
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    chosen = [
        (
            f["name"],
            ANY_ARGUMENTS
            if strict_only and not f.get("strict")
            else f.get("parameters") or {"type": "object", "properties": {}},
        )
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
    # Special tokens of the model's vocabulary the format writes (Kimi K2's <|...|> markers).
    markers: tuple[str, ...] = ()
    # Where a grammar over free text lets a call begin (`auto_grammar`): the opener a model
    # writes first, and whether it is the start of each call (else of the block of calls).
    trigger: str
    trigger_starts_call: bool = False

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
        self,
        tools: list[dict],
        *,
        only: str | None = None,
        parallel: bool = True,
        special: Mapping[str, int] = NO_SPECIAL,
    ) -> str:
        """A Lark grammar for llguidance whose sentences are one call (with `parallel`, one or more)
        of one of `tools` (or of the tool named `only`), its arguments satisfying the tool's
        schema. `special`: the markers that are special tokens of the model's vocabulary, and
        their ids (`special_markers`)."""
        chosen = _chosen_tools(tools, only)
        rules = [
            rule
            for i, (name, params) in enumerate(chosen)
            for rule in self._call_rules(f"call_{i}", name, params, special)
        ]
        begin, separator, end = self._frame(special)
        calls = f"call ({separator} call)*" if parallel and separator else "call+" if parallel else "call"
        start = " ".join(part for part in (begin, calls, end) if part)
        return "\n".join([f"start: {start}", "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))), *rules])

    def auto_grammar(self, tools: list[dict], *, parallel: bool = True, special: Mapping[str, int] = NO_SPECIAL) -> str:
        """A grammar for `tool_choice: "auto"`: free text, in which a call begins where the
        model writes the format's `trigger`; from there the call is constrained, the arguments
        of `strict` tools to their schema and the others to any JSON object. Without
        `parallel` the output holds at most one call and ends with it.

        The trigger is a lazy lexeme (llguidance ends the text at its first occurrence), or a
        special token, which free text cannot hold."""
        chosen = _chosen_tools(tools, None, strict_only=True)
        rules = [
            rule
            for i, (name, params) in enumerate(chosen)
            for rule in self._call_rules(f"call_{i}", name, params, special)
        ]
        begin, separator, end = self._frame(special)
        if self.trigger_starts_call:  # each call opens with the trigger: the first one is cut
            rules += [
                rule
                for i, (name, params) in enumerate(chosen)
                for rule in self._call_rules(f"first_{i}", name, params, special, after=self.trigger)
            ]
            rest = "first" + (f" ({separator} call)*" if parallel else "")
        else:  # the trigger opens the block
            trigger = _marker(self.trigger, special)
            assert begin.startswith(trigger), (self.name, begin)
            calls = f"call ({separator} call)*" if parallel and separator else "call+" if parallel else "call"
            rest = " ".join(part for part in (begin[len(trigger) :].strip(), calls, end) if part)
        if self.trigger in special:
            opening = f"before_call: TEXT {_marker(self.trigger, special)}"
        else:
            opening = f"before_call[lazy]: TEXT {_lark(self.trigger)}"
        start = "(before_call block)* TEXT" if parallel else "TEXT | before_call block"
        return "\n".join(
            [
                "%llguidance {}",
                f"start: {start}",
                f"block: {rest}",
                opening,
                "TEXT: /(.|\\n)*/",
                "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))),
                *(
                    ["first: " + " | ".join(f"first_{i}" for i in range(len(chosen)))]
                    if self.trigger_starts_call
                    else []
                ),
                *rules,
            ]
        )

    def special_markers(self, tokenizer) -> dict[str, int]:
        """{marker: token id} for the format's markers that are special tokens of `tokenizer`."""
        ids = {m: tokenizer.special_token_id(m) for m in self.markers}
        return {m: i for m, i in ids.items() if i is not None}

    def render_calls(self, calls: list[dict]) -> str:
        """The text that an assistant message's OpenAI `tool_calls` stand for in this format."""
        raise NotImplementedError

    # -- grammar parts --

    def _frame(self, special: Mapping[str, int]) -> tuple[str, str, str]:
        """Lark for what comes before the calls, between them, and after them."""
        raise NotImplementedError

    def _call_rules(self, rule: str, name: str, params: dict, special: Mapping[str, int], after: str = "") -> list[str]:
        """Lark rules, the first named `rule`, for one call of the tool; `after`: the call's
        text from just after this opening (which something else has matched)."""
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

    def _call_rules(self, rule, name, params, special, after=""):
        before, closing = self.call_wrap
        prefix = f'{before}{{"name": {json.dumps(name)}, "{self.arguments_key}": '
        assert prefix.startswith(after), (prefix, after)
        prefix = prefix[len(after) :]
        return [f"{rule}: {_lark(prefix)} {rule}_args {_lark('}' + closing)}", f"{rule}_args: {_json_rule(params)}"]


class Hermes(_JsonObjectCalls):
    name = "hermes"
    openers = ("<tool_call>",)
    trigger, trigger_starts_call = "<tool_call>", True
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

    def _frame(self, special):
        return "", _lark("\n"), ""


class Llama3Json(_JsonObjectCalls):
    name = "llama3_json"
    openers = ("<|python_tag|>", "{")
    trigger, trigger_starts_call = "{", True
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

    def _frame(self, special):
        return "", _lark("; "), ""


class Llama4Pythonic(ToolCallFormat):
    name = "llama4_pythonic"
    openers = ("<|python_start|>", "[")
    trigger = "["
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

    def _frame(self, special):
        return _lark("["), _lark(", "), _lark("]")

    def _call_rules(self, rule, name, params, special, after=""):
        # Values are written as JSON (%json): JSON strings, numbers, lists and objects are Python
        # literals too, and the parser reads true/false/null. Keyword arguments come in the
        # schema's order, required ones always; only the schema's properties are offered.
        if params is ANY_ARGUMENTS:  # any keywords, any values
            value = f"/[A-Za-z_][A-Za-z0-9_]*=/ {_json_rule({})}"
            return [f"{rule}: {_lark(name + '(')} ({value} ({_lark(', ')} {value})*)? {_lark(')')}"]
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
    markers = (
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    )
    trigger = "<|tool_calls_section_begin|>"
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

    def _frame(self, special):
        return (
            _marker("<|tool_calls_section_begin|>", special),
            "",
            _marker("<|tool_calls_section_end|>", special),
        )

    def _call_rules(self, rule, name, params, special, after=""):
        begin, arguments, end = (
            _marker(f"<|tool_call_{part}|>", special) for part in ("begin", "argument_begin", "end")
        )
        return [
            f"{rule}: {begin} {_lark(f'functions.{name}:')} /[0-9]{{1,9}}/ {arguments} {rule}_args {end}",
            f"{rule}_args: {_json_rule(params)}",
        ]
