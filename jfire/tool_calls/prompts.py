"""Choosing a model's tool-call format and making chat messages with tools renderable by its
chat template."""

from __future__ import annotations

import json
import re

from jfire.tool_calls.formats import Hermes, KimiK2, Llama3Json, Llama4Pythonic, ToolCallFormat
from jfire.tool_calls.more_formats import DeepSeekV3, DeepSeekV31, Llama4Json, Mistral
from jfire.tool_calls.scan import _json_or_none

FORMATS: dict[str, ToolCallFormat] = {
    f.name: f
    for f in (Hermes(), Llama3Json(), Llama4Pythonic(), Llama4Json(), KimiK2(), Mistral(), DeepSeekV3(), DeepSeekV31())
}
_FORMAT_BY_MODEL_TYPE = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "llama4": "llama4_pythonic",
    "llama4_text": "llama4_pythonic",
    "kimi_k2": "kimi_k2",
    "kimi_k25": "kimi_k2",
    "deepseek_v3": "deepseek_v3",
}


def format_for(chat_template: str | None, model_type: str | None = None) -> ToolCallFormat:
    """The format the model calls tools in: from markers in its chat template, else from its
    model type, else hermes (which default_tool_prompt teaches templates without tool support)."""
    template = chat_template or ""
    if "<|tool_calls_section_begin|>" in template:
        return FORMATS["kimi_k2"]
    if "<｜tool▁calls▁begin｜>" in template:  # DeepSeek: V3 and R1 fence the arguments as ```json, V3.1 not
        return FORMATS["deepseek_v3" if "```json" in template else "deepseek_v31"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "[func_name1(" in template:  # Llama 4's pythonic instructions
        return FORMATS["llama4_pythonic"]
    if "<|python_start|>" in template:
        # Llama 4's released template asks for JSON calls ("parameters") and writes them so.
        return FORMATS["llama4_json" if '"parameters"' in template else "llama4_pythonic"]
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
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
        f"</tools>\n\n{fmt.instructions}"
    )


def prepare_messages(
    messages: list[dict], tools: list[dict] | None, chat_template: str | None, fmt: ToolCallFormat
) -> list[dict]:
    """OpenAI chat messages made renderable by the chat template.

    A template with tool support gets them as they are, except that tool calls' `arguments` JSON
    text is also given parsed (HF templates iterate over it as a mapping), and content None as ""
    (Qwen 3's and DeepSeek's templates read the content of a turn that only calls tools, and a
    None content, dropped as HF drops it, leaves it undefined). One without gets:
    - the tool prompt at the end of the system message (a system message is added if none);
    - each assistant message's tool calls appended to its content as text (render_calls);
    - each run of tool results as one message, each result in <tool_response>...</tool_response>
      as Hermes' template writes them, with role "tool" (templates that print any role, like the
      default model's, show it as such) or, for a template that raises on roles it does not
      know (it calls raise_exception), role "user";
    - content None as "", so that the template prints nothing for it.
    """
    if template_takes_tools(chat_template):
        return [_for_template_with_tools(m) for m in messages]
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


def _for_template_with_tools(message: dict) -> dict:
    if message.get("content") is None:
        message = {**message, "content": ""}
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
