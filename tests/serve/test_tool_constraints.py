"""Tool calls constrained as the model was trained to write them, through `jfire serve` and the
official openai client, on a tiny Kimi K2.5-layout model (int4 experts, the text model under
`language_model.`) with a Kimi tiktoken tokenizer whose tool-call markers are special tokens.

The model's weights are arranged so it ranks the whole vocabulary the same way at every
position: attention and MLP outputs are zero (the residual stream is the token's embedding),
the final norm keeps one dimension that every embedding has positive, and the output layer's
column for it is the ranking. The markers <|tool_calls_section_begin|> and <|tool_call_begin|>
rank first and second, so greedy decoding starts a call at once and starts another whenever a
call may follow; everything else it writes is what the grammar allows."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest
import torch
from safetensors.numpy import save_file

from jfire.kernels.int4_experts import pack_int4
from tests.serve.server_process import start_server
from tests.tiny_models import tiny_hf_config

N_BYTES, N_SPECIAL = 256, 256  # one rank per byte, then the specials, as Kimi's ids run
# Offsets from the rank count, as in Kimi K2's tokenizer_config.json.
NAMED = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
}
ID = {name: N_BYTES + offset for offset, name in NAMED.items()}
MARKERS = [ID[m] for m in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                           "<|tool_call_end|>", "<|tool_calls_section_end|>")]
# Kimi K2-Thinking's released chat template (tests/data/chat_templates/SOURCES.md).
TEMPLATE = (Path(__file__).parent.parent / "data" / "chat_templates" / "moonshotai-Kimi-K2-Thinking.jinja").read_text()
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "urgent": {"type": "boolean"}},
    "required": ["unit", "urgent"],
    "additionalProperties": False,
}
NOT_SCHEMA = {"type": "object", "properties": {"city": {"not": {"type": "integer"}}}}
MESSAGES = [{"role": "user", "content": "What is the weather like?"}]


def tool(name: str, parameters: dict, strict: bool = False) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters, "strict": strict}}


def write_tokenizer(path) -> None:
    ranks = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(N_BYTES))
    (path / "tiktoken.model").write_text(ranks)
    added = {
        str(N_BYTES + k): {"content": NAMED.get(k, f"<|reserved_token_{N_BYTES + k}|>"), "special": True}
        for k in range(N_SPECIAL)
    }
    (path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ID["<|im_end|>"]}))


def write_model(path, scratch) -> None:
    """The released K2.5 layout: config `kimi_k25` nesting the text model, int4 routed experts."""
    from safetensors.numpy import load_file
    from transformers import DeepseekV3ForCausalLM

    config = tiny_hf_config("kimi_k2")
    config.vocab_size = N_BYTES + N_SPECIAL
    config.max_position_embeddings = 1024  # one byte a token: tool declarations are long
    config.rope_parameters["original_max_position_embeddings"] = 128  # YaRN's factor 8 of it
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(scratch)  # experts one by one, as released
    state = {k: v.copy() for k, v in load_file(scratch / "model.safetensors").items()}
    rng = np.random.default_rng(0)
    for name, value in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value[:] = 0  # no layer adds to the residual stream
    state["model.embed_tokens.weight"][:, 0] = 1.0
    state["model.norm.weight"][:] = 0
    state["model.norm.weight"][0] = 1.0
    ranking = rng.normal(size=config.vocab_size).astype(np.float32)
    ranking[ID["<|tool_calls_section_begin|>"]], ranking[ID["<|tool_call_begin|>"]] = 30.0, 29.0
    state["lm_head.weight"][:, 0] = ranking
    tensors = {}
    for name, value in state.items():
        if ".mlp.experts." in name:
            packed, scale = pack_int4(value, 32)
            stem = name[: -len("weight")]
            tensors.update({stem + "weight_packed": packed, stem + "weight_scale": np.asarray(scale),
                            stem + "weight_shape": np.asarray(value.shape, np.int32)})
        else:
            tensors[name] = value
    out = {"language_model." + k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(out, path / "model.safetensors")
    text = {**config.to_dict(), "model_type": "kimi_k2"}
    quantization = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }
    (path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "quantization_config": quantization}))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_k25_tools")
    write_tokenizer(path)
    write_model(path, tmp_path_factory.mktemp("scratch"))
    server = start_server(["--model", str(path), "--served-model-name", "tiny", "--max-batch", "2", "--max-context", "1024"],
                          tmp_path_factory.mktemp("log") / "serve.log")
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 96)
    return client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, extra_body={"return_token_ids": True}, **kwargs)


def calls_of(response) -> list[tuple[str, dict]]:
    """The calls of the first choice, but one that max_tokens cut short."""
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    if choice.finish_reason == "length":
        calls = calls[:-1]
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_writes_the_markers_as_their_special_tokens(client, choice):
    response = chat(client, tools=[tool("get_weather", WEATHER)], tool_choice=choice, parallel_tool_calls=False)
    ids = response.choices[0].model_extra["token_ids"]
    # One token each, in the order the format writes them; never spelled out in bytes ("<" is 60).
    assert [i for i in ids if i in MARKERS] == MARKERS
    assert ord("<") not in ids
    assert response.choices[0].finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(response)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER)
    assert response.choices[0].message.tool_calls[0].id.startswith("functions.get_weather:")


def test_streamed_token_ids_are_the_whole_responses(client):
    whole = chat(client, tools=[tool("get_weather", WEATHER)], tool_choice="required", parallel_tool_calls=False)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=96, stream=True, tools=[tool("get_weather", WEATHER)],
        tool_choice="required", parallel_tool_calls=False, extra_body={"return_token_ids": True})
    chunks = list(stream)
    streamed = [i for chunk in chunks for c in chunk.choices for i in (c.model_extra.get("token_ids") or [])]
    assert streamed == whole.choices[0].model_extra["token_ids"]
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]


def test_strict_constrains_the_arguments_of_a_call_the_model_starts_under_auto(client):
    response = chat(client, tools=[tool("get_weather", WEATHER, strict=True)], tool_choice="auto")
    calls = calls_of(response)
    assert calls and all(name == "get_weather" for name, _ in calls)
    for _, arguments in calls:
        jsonschema.validate(arguments, WEATHER)


def test_parallel_tool_calls_false_allows_one_call_under_auto(client):
    tools = [tool("get_weather", WEATHER, strict=True)]
    several = chat(client, tools=tools, tool_choice="auto")
    assert len(several.choices[0].message.tool_calls) > 1  # the model would call again and again
    one = chat(client, tools=tools, tool_choice="auto", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    assert one.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(calls_of(one)[0][1], WEATHER)


def test_an_unsupported_schema_keyword_is_the_same_400_under_tools_and_response_format(client):
    errors = {}
    for where, kwargs in {
        "tools (forced)": dict(tools=[tool("lookup", NOT_SCHEMA)], tool_choice="required"),
        "tools (strict, auto)": dict(tools=[tool("lookup", NOT_SCHEMA, strict=True)]),
        "response_format": dict(response_format={"type": "json_schema",
                                                 "json_schema": {"name": "lookup", "schema": NOT_SCHEMA}}),
    }.items():
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, **kwargs)
        errors[where] = e.value.body
    for where, body in errors.items():
        assert '"not"' in body["message"] and "cannot enforce" in body["message"], (where, body)
    assert errors["tools (forced)"]["param"] == errors["tools (strict, auto)"]["param"] == "tools"
    assert errors["response_format"]["param"] == "response_format"
    # The same words after the field each names.
    reasons = {body["message"].split(": ", 1)[1] for body in errors.values()}
    assert len(reasons) == 1, reasons
    # Where jfire enforces no schema (auto, not strict), the tool is offered as it is.
    assert chat(client, tools=[tool("lookup", NOT_SCHEMA)], max_tokens=4).choices[0].finish_reason
