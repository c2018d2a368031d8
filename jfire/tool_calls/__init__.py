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
- llama4_pythonic (Llama 4 prompted as Meta's docs and vLLM's template do; Gemma 3's prompt asks
  for the same), a Python list of calls whose arguments are Python literals, optionally wrapped
  in `<|python_start|>...<|python_end|>`:
      [get_weather(city="Paris"), get_time(tz="UTC")]
- llama4_json (Llama 4's released chat template, which asks for JSON calls), after an empty
  `<|python_start|><|python_end|>`, one object after another:
      <|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}
- kimi_k2 (Kimi K2 / K2.5), special tokens around the calls, each call's id naming its function
  (one line in the output):
      <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
      <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
- mistral (Mistral 7B v0.3, Mistral-Nemo: the JSON-list form), a list of calls after
  [TOOL_CALLS]; jfire's call ids are 9 letters and digits, the only ids these templates accept:
      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
- deepseek_v3 (DeepSeek-V3, R1) and deepseek_v31 (DeepSeek-V3.1), each reading both (V3.1
  writes each call as `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`):
      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
      ```json
      {"city": "Paris"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text outside calls is content. Whitespace before a call, between calls, and after the last call
at the end of the output is framing, not content. A call that is malformed (bad JSON, unknown
structure, unterminated) stays in the content verbatim, except a call cut short by max_tokens
once its name is known: it stays a call, its arguments exactly as far as the model wrote them
(never closed or completed), with finish_reason "length", as OpenAI returns it. JSON formats must write "name" first,
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

from jfire.tool_calls.formats import Hermes, KimiK2, Llama3Json, Llama4Pythonic, ToolCallFormat
from jfire.tool_calls.more_formats import DeepSeekV3, DeepSeekV31, Llama4Json, Mistral
from jfire.tool_calls.prompts import FORMATS, default_tool_prompt, format_for, prepare_messages, template_takes_tools
from jfire.tool_calls.stream import ToolCall, ToolCallStream, new_call_id

__all__ = [
    "FORMATS",
    "DeepSeekV3",
    "DeepSeekV31",
    "Hermes",
    "KimiK2",
    "Llama3Json",
    "Llama4Json",
    "Llama4Pythonic",
    "Mistral",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallStream",
    "default_tool_prompt",
    "format_for",
    "new_call_id",
    "prepare_messages",
    "template_takes_tools",
]
