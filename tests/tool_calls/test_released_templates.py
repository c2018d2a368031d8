"""Each tool-call format against the released chat templates of the families it serves
(tests/data/chat_templates, their sources in SOURCES.md there). A conversation whose assistant
turn calls tools is rendered through the real template by transformers' renderer (as
apply_chat_template renders it); what the template writes for that turn after the generation
prompt is the text the model learned to write, and it must parse back into exactly the calls
that went in: names, and arguments with nested objects, arrays, null, non-ASCII text, quotes and
backslashes. jfire must choose that format for the template, and its serving path
(prepare_messages, from the messages an OpenAI client sends) must render calls that parse back
too."""

from __future__ import annotations

import dataclasses
import json
import os.path
from pathlib import Path

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from jfire.tool_calls import FORMATS, format_for, prepare_messages, template_takes_tools

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "options": {
                        "type": "object",
                        "properties": {
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                            "days": {"type": "integer"},
                            "hourly": {"type": "boolean"},
                            "around": {"type": "object"},
                        },
                    },
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_notes",
            "description": "Search the user's notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {
                        "type": "object",
                        "properties": {
                            "tags": {"type": "array", "items": {"type": "string"}},
                            "limit": {"type": ["integer", "null"]},
                        },
                    },
                },
                "required": ["query"],
            },
        },
    },
]
CALLS = [
    (
        "get_weather",
        {
            "city": "Zürich",
            "options": {"unit": "celsius", "days": 3, "hourly": True, "around": {"km": 2.5, "towns": ["Baden", "Zug"]}},
        },
    ),
    (
        "search_notes",
        {"query": 'say "hi" \\ {not json} — 東京 ☕', "filters": {"tags": ["plan", "été"], "limit": None}},
    ),
]


@dataclasses.dataclass(frozen=True)
class Case:
    template: str  # a file under TEMPLATES
    model_type: str  # the family's config.json model_type
    format: str  # the format jfire must choose, and which reads what the template writes
    stop: str  # what the template writes after the calls: the model's stop token, not its output
    calls: int = 2  # calls in the turn (Llama 3.x's template refuses more than one)
    ids: tuple[str, str] = ("call_a1", "call_b2")  # call ids of the form the template accepts
    keeps_ids: bool = False  # the format reads the ids the template writes (Kimi's name the function)
    text_arguments: bool = False  # the template writes arguments JSON text as given, not a mapping
    content: str = ""  # what parsing leaves as content: the empty think block a template writes


CASES = [
    Case("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama", "llama3_json", "<|eot_id|>", calls=1),
    Case("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama", "llama3_json", "<|eot_id|>", calls=1),
    Case("transformers-llama4-processing_llama4.jinja", "llama4", "llama4_json", "<|eot|>"),
    Case("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2", "hermes", "<|im_end|>\n"),
    Case("Qwen-Qwen3-0.6B.jinja", "qwen3", "hermes", "<|im_end|>\n", content="<think>\n\n</think>"),
    Case("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", "mistral", "</s>", ids=("a1B2c3D4e", "Z9y8X7w6V")),
    Case("vllm-tool_chat_template_deepseekv3.jinja", "deepseek_v3", "deepseek_v3", "<｜end▁of▁sentence｜>\n"),
    Case(
        "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3", "deepseek_v31", "<｜end▁of▁sentence｜>", text_arguments=True
    ),
    Case(
        "moonshotai-Kimi-K2-Thinking.jinja",
        "kimi_k2",
        "kimi_k2",
        "<|im_end|>",
        ids=("functions.get_weather:0", "functions.search_notes:1"),
        keeps_ids=True,
        content="<think></think>",
    ),
]
IDS = [case.template.removesuffix(".jinja") for case in CASES]


def _conversation(case: Case, *, arguments_as_text: bool, content: str | None) -> list[dict]:
    calls = [
        {
            "id": case.ids[i],
            "type": "function",
            "function": {
                "name": name,
                "arguments": json.dumps(arguments, ensure_ascii=False) if arguments_as_text else arguments,
            },
        }
        for i, (name, arguments) in enumerate(CALLS[: case.calls])
    ]
    return [
        {"role": "user", "content": "The weather in Zürich for 3 days, and my notes on it?"},
        {"role": "assistant", "content": content, "tool_calls": calls},
    ]


def _render(template: str, messages: list[dict], tools, generation_prompt: bool) -> str:
    # None-valued keys dropped, as apply_chat_template (and jfire) drop them; Mistral's BOS and
    # EOS (the other templates write their own markers literally).
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return render_jinja_template(
        [messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
    )[0][0]


def _assistant_turn(case: Case, template: str, messages: list[dict], tools) -> str:
    """What the template writes for the last message, the assistant's, after the generation
    prompt: the text the model writes, without the stop token that ends it."""
    prompt, whole = _render(template, messages[:-1], tools, True), _render(template, messages, tools, False)
    turn = whole[len(os.path.commonprefix([prompt, whole])) :]
    assert turn.endswith(case.stop), turn
    return turn.removesuffix(case.stop)


def _streamed(fmt, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, calls) from the stream parser fed one character at a time."""
    parser = fmt.stream_parser()
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    content = "".join(e["content"] for e in events if "content" in e)
    names = [e["function"]["name"] for e in events if "id" in e]
    arguments = ["".join(e["function"]["arguments"] for e in events if e.get("index") == i) for i in range(len(names))]
    return content, [(n, json.loads(a)) for n, a in zip(names, arguments)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jfire_chooses_the_format_the_template_writes(case):
    template = (TEMPLATES / case.template).read_text(encoding="utf-8")
    assert format_for(template, case.model_type).name == case.format
    assert format_for(template).name == case.format  # the template's markers alone decide


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_calls_the_template_writes_parse_back_exactly(case):
    template = (TEMPLATES / case.template).read_text(encoding="utf-8")
    fmt = FORMATS[case.format]
    messages = _conversation(case, arguments_as_text=case.text_arguments, content="")
    output = _assistant_turn(case, template, messages, TOOLS)
    content, calls = fmt.parse(output)
    assert content == case.content, output
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[: case.calls], output
    if case.keeps_ids:
        assert [c.id for c in calls] == list(case.ids[: case.calls])
    assert _streamed(fmt, output) == (case.content, CALLS[: case.calls])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jfires_serving_path_renders_calls_that_parse_back(case):
    """From the messages an OpenAI client sends (arguments as JSON text, content null), through
    prepare_messages: a template with tool support renders the calls itself, one without gets
    them rendered by the format (DeepSeek-V3.1's, which takes no `tools`)."""
    template = (TEMPLATES / case.template).read_text(encoding="utf-8")
    fmt = format_for(template, case.model_type)
    prepared = prepare_messages(_conversation(case, arguments_as_text=True, content=None), TOOLS, template, fmt)
    tools = TOOLS if template_takes_tools(template) else None
    content, calls = fmt.parse(_assistant_turn(case, template, prepared, tools))
    assert content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[: case.calls]


def test_mistral_call_ids_are_ones_its_template_accepts():
    """Clients send a call's id back with its result; Mistral's template refuses any id that is
    not 9 letters and digits, such as jfire's call_<hex> ids."""
    case = next(c for c in CASES if c.format == "mistral")
    template = (TEMPLATES / case.template).read_text(encoding="utf-8")
    _, calls = FORMATS["mistral"].parse(
        _assistant_turn(case, template, _conversation(case, arguments_as_text=False, content=""), TOOLS)
    )
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)

    def follow_up(ids):
        assistant = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, CALLS)
            ],
        }
        results = [{"role": "tool", "tool_call_id": i, "content": '{"ok": true}'} for i in ids]
        return _render(template, [{"role": "user", "content": "Go."}, assistant, *results], TOOLS, True)

    text = follow_up([c.id for c in calls])
    assert all(f'"call_id": "{c.id}"' in text for c in calls)
    with pytest.raises(jinja2.TemplateError, match="length 9"):
        follow_up(["call_" + "0" * 24, "call_" + "1" * 24])


def test_vllms_llama4_pythonic_template_parses_back_with_plain_string_arguments():
    """vLLM's pythonic Llama 4 template (whose instructions jfire reads as llama4_pythonic) writes
    every value as "%s" in double quotes: objects come out as their Python repr, a string, and
    quotes go unescaped. Values that survive that, plain strings, parse back exactly."""
    template = (TEMPLATES / "vllm-tool_chat_template_llama4_pythonic.jinja").read_text(encoding="utf-8")
    case = Case("vllm-tool_chat_template_llama4_pythonic.jinja", "llama4", "llama4_pythonic", "<|eot|>")
    assert format_for(template, case.model_type).name == case.format
    calls = [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("search_notes", {"query": "été — 東京 notes"})]
    messages = [
        {"role": "user", "content": "Weather and notes?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)
            ],
        },
    ]
    content, parsed = FORMATS[case.format].parse(_assistant_turn(case, template, messages, TOOLS))
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
