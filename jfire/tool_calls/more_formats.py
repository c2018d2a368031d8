"""The tool-call formats of Llama 4's released chat template (llama4_json), Mistral (mistral) and
DeepSeek-V3 / V3.1 (deepseek_v3, deepseek_v31), read and constrained with formats.py's machinery.
Each is what the family's released chat template writes for past calls (tests/tool_calls)."""

from __future__ import annotations

import json
import re
import secrets
import string

from jfire.tool_calls.formats import (
    Llama3Json,
    ToolCallFormat,
    _arguments_of,
    _json_rule,
    _JsonObjectCalls,
    _lark,
    _marker,
)
from jfire.tool_calls.scan import _JSON_NAME, _Mismatch


class Llama4Json(Llama3Json):
    """Llama 4's released chat template asks for JSON calls ({"name": ..., "parameters": ...})
    and writes a past call turn as <|python_start|>{text}<|python_end|> followed by the calls, one
    object after another with nothing between them."""

    name = "llama4_json"
    openers = ("<|python_start|>", "{")
    instructions = (
        "To call functions, respond with only JSON objects in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}, '
        "one after another when you call more than one. Do not use variables."
    )

    def head(self, c, first):
        if first and c.opt("<|python_start|>"):
            c.ws()
            c.opt("<|python_end|>")  # the template's pair, empty when the turn has no text
        return self._json_head(c), None

    def after_call(self, c):
        another = super().after_call(c)  # a next "{" opens the next call as a block of its own
        if not another:
            end = c.pos
            c.ws()
            if not c.opt("<|python_end|>"):  # the calls written inside the pair instead
                c.pos = end
        return another

    def render_calls(self, calls):
        return "".join(map(self._call_text, calls))

    def _frame(self, special):
        return "", "", ""


def _mistral_call_id() -> str:
    # Mistral's templates refuse a call id that is not 9 letters and digits (raise_exception),
    # and clients send back the ids jfire gave the calls.
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


class Mistral(_JsonObjectCalls):
    """[TOOL_CALLS] and a JSON list of calls, as Mistral 7B v0.3 and Mistral-Nemo write them (the
    former with a space after [TOOL_CALLS]); in past turns each call's "id" follows its arguments."""

    name = "mistral"
    openers = ("[TOOL_CALLS]",)
    markers = ("[TOOL_CALLS]",)
    trigger = "[TOOL_CALLS]"
    arguments_key = "arguments"
    instructions = (
        "To call functions, write [TOOL_CALLS] followed by a JSON list of the calls:\n"
        '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]\n'
        "with one object per call."
    )

    def head(self, c, first):
        if first:
            c.expect("[TOOL_CALLS]", "[")
        return self._json_head(c), _mistral_call_id()

    def after_call(self, c):
        c.ws()
        if c.opt(","):  # the call's id, which the model may copy from past turns; jfire gives its own
            c.expect('"id"', ":", '"')
            c.token(_JSON_NAME)
            c.expect('"')
        c.expect("}")
        c.ws()
        if c.opt(","):
            return True
        c.expect("]")
        return False

    def render_calls(self, calls):
        rendered = []
        for call in calls:
            text = self._call_text(call)
            if _MISTRAL_ID.fullmatch(call.get("id") or ""):
                text = f'{text[:-1]}, "id": "{call["id"]}"}}'
            rendered.append(text)
        return "[TOOL_CALLS][" + ", ".join(rendered) + "]"

    def _frame(self, special):
        return f"{_marker('[TOOL_CALLS]', special)} {_lark('[')}", _lark(", "), _lark("]")


_CALLS_BEGIN, _CALL_BEGIN, _SEP, _CALL_END, _CALLS_END = (
    f"<｜tool▁{part}｜>" for part in ("calls▁begin", "call▁begin", "sep", "call▁end", "calls▁end")
)


_FENCE_OPEN, _FENCE_CLOSE = "\n```json\n", "\n```"


class DeepSeekV3(ToolCallFormat):
    """DeepSeek-V3 and R1: each call <｜tool▁call▁begin｜>function<｜tool▁sep｜>name, then the
    arguments fenced as ```json, the calls "\\n"-separated inside <｜tool▁calls▁begin｜> ...
    <｜tool▁calls▁end｜>. Reads V3.1's calls too (name<｜tool▁sep｜>arguments, unfenced)."""

    name = "deepseek_v3"
    openers = (_CALLS_BEGIN,)
    markers = (_CALLS_BEGIN, _CALL_BEGIN, _SEP, _CALL_END, _CALLS_END)
    trigger = _CALLS_BEGIN
    instructions = (
        f"To call functions, first write {_CALLS_BEGIN}, then for each call "
        f"{_CALL_BEGIN}function{_SEP}<function-name>\n```json\n<args-json-object>\n```{_CALL_END}\n"
        f"and after the last call {_CALLS_END}."
    )

    def head(self, c, first):
        if first:
            c.expect(_CALLS_BEGIN)
        c.expect(_CALL_BEGIN)
        word = c.token(_JSON_NAME)
        c.expect(_SEP)
        c.ws()
        if c.starts("{"):  # V3.1: the name before the separator, the arguments right after it
            return word, None
        if word != "function":  # V3: the call's type before the separator
            raise _Mismatch
        name = c.token(_JSON_NAME)
        c.expect("```json")
        c.peek("{")
        return name, None

    def after_call(self, c):
        c.ws()
        c.opt("```")  # V3's fence
        c.expect(_CALL_END)
        c.ws()
        if c.starts(_CALL_BEGIN):
            return True
        c.expect(_CALLS_END)
        return False

    def render_calls(self, calls):
        return _CALLS_BEGIN + "\n".join(map(self._call_text, calls)) + _CALLS_END

    def _call_text(self, call: dict) -> str:
        arguments = json.dumps(_arguments_of(call), ensure_ascii=False)
        return f"{_CALL_BEGIN}function{_SEP}{call['function']['name']}\n```json\n{arguments}\n```{_CALL_END}"

    def _frame(self, special):
        return _marker(_CALLS_BEGIN, special), _lark("\n"), _marker(_CALLS_END, special)

    def _call_rules(self, rule, name, params, special, after=""):
        begin, sep, end = (_marker(m, special) for m in (_CALL_BEGIN, _SEP, _CALL_END))
        opening = f"{begin} {_lark('function')} {sep} {_lark(name + _FENCE_OPEN)}"
        closing = f"{_lark(_FENCE_CLOSE)} {end}"
        return [f"{rule}: {opening} {rule}_args {closing}", f"{rule}_args: {_json_rule(params)}"]


class DeepSeekV31(DeepSeekV3):
    """DeepSeek-V3.1: each call <｜tool▁call▁begin｜>name<｜tool▁sep｜>arguments<｜tool▁call▁end｜>,
    the calls chained with nothing between them."""

    name = "deepseek_v31"
    instructions = (
        f"To call functions, write {_CALLS_BEGIN}{_CALL_BEGIN}<function-name>{_SEP}<args-json-object>"
        f"{_CALL_END}{_CALLS_END}, chaining further calls ({_CALL_BEGIN}...{_CALL_END}) directly "
        "after the first, without separators."
    )

    def render_calls(self, calls):
        return _CALLS_BEGIN + "".join(map(self._call_text, calls)) + _CALLS_END

    def _call_text(self, call: dict) -> str:
        arguments = json.dumps(_arguments_of(call), ensure_ascii=False)
        return f"{_CALL_BEGIN}{call['function']['name']}{_SEP}{arguments}{_CALL_END}"

    def _frame(self, special):
        return _marker(_CALLS_BEGIN, special), "", _marker(_CALLS_END, special)

    def _call_rules(self, rule, name, params, special, after=""):
        opening = f"{_marker(_CALL_BEGIN, special)} {_lark(name)} {_marker(_SEP, special)}"
        return [f"{rule}: {opening} {rule}_args {_marker(_CALL_END, special)}", f"{rule}_args: {_json_rule(params)}"]
