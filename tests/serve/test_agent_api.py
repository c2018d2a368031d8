"""The OpenAI API as coding agents use it, against a real `jfire serve` of the default model
with the official openai client: structured outputs validate against their schemas, forced
tool calls validate against their tools' schemas (plain and streamed), tool-result turns
complete, logprobs equal a log-softmax of transformers' logits, n > 1, and penalties give
the tokens a reference implementation of OpenAI's formula gives on transformers' logits."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from tests.limits import SERVE_LIMITS
from tests.serve.server_process import start_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    srv = start_server(SERVE_LIMITS, tmp_path_factory.mktemp("agent") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def token_ids_of():
    """bytes -> token id for the default model's vocabulary (logprobs name tokens by bytes)."""
    from jfire.checkpoint.load import load_config_and_tokenizer

    cfg, tok = load_config_and_tokenizer("default")[:2]
    table: dict[bytes, int] = {}
    for i in reversed(range(tok.vocab_size)):  # the lowest id wins a tie
        table[tok.token_bytes(i)] = i
    return lambda entries: [table[bytes(e.bytes)] for e in entries]


@pytest.fixture(scope="module")
def reference(default_hf_reference):
    """transformers on the same GGUF in float64: the independent source of logits. Float64
    rather than float32 so that the reference's own rounding is not in the comparison: a float32
    transformers gives this machine's jfire within 1e-5 of float64, but on another CPU its
    float32 kernels put one logprob 2.3e-4 away from both."""
    import copy

    tok, model = default_hf_reference
    return tok, copy.deepcopy(model).double()


def prompt_ids(tok, messages) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """Next-token logits at every position of ids."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


# -- structured outputs ----------------------------------------------------------------------


def test_strict_json_schema_validates_for_20_seeded_samples(client):
    def one(seed: int):
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Describe a fictional person as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            temperature=0.8, seed=seed, max_tokens=150)
        return r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(one, range(20)))
    documents = []
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        document = json.loads(choice.message.content)
        jsonschema.validate(document, PERSON)  # enums, bounds, required, no extra keys
        documents.append(document)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 1  # sampled, not one forced answer


def test_json_object_parses(client):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "List three fruits as a JSON object."}],
        response_format={"type": "json_object"}, temperature=0.7, seed=1, max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_take_response_format_too(client):
    r = client.completions.create(model="default", prompt="A person, as JSON:", max_tokens=120, temperature=0.5,
                                  seed=2, extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "person", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_constrained_rows_batched_with_free_rows_get_their_tokens_alone(client):
    """A constrained request and free ones share decode steps (the server batches 4 rows):
    each gets exactly the tokens it gets alone."""
    constrained = dict(messages=[{"role": "user", "content": "A person as JSON."}], temperature=0.9, seed=7,
                       max_tokens=80, response_format={"type": "json_schema", "json_schema": {
                           "name": "person", "schema": PERSON}})
    free = [dict(messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}], temperature=1.0,
                 seed=i, max_tokens=30) for i in range(3)]

    def run(kwargs):
        return client.chat.completions.create(model="default", **kwargs).choices[0].message.content

    alone = [run(k) for k in [constrained, *free]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, [constrained, *free]))
    assert together == alone
    jsonschema.validate(json.loads(alone[0]), PERSON)


# -- tools -----------------------------------------------------------------------------------


def check_calls(calls, only: str | None = None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(client, **kwargs):
    """(tool calls assembled from delta.tool_calls increments, finish_reason)."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="default", stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_validate_plain_and_streamed(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=0,
                  max_tokens=80)
    r = client.chat.completions.create(model="default", **kwargs)
    only = None if choice == "required" else "get_time"
    check_calls(r.choices[0].message.tool_calls, only)
    assert r.choices[0].finish_reason == "tool_calls"
    streamed, finish = streamed_calls(client, **kwargs)
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert all(c["id"] for c in streamed)


def test_a_forced_call_cut_by_max_tokens_says_so_with_its_arguments_as_generated(client):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    whole = client.chat.completions.create(model="default", max_tokens=80, **kwargs)
    full = whole.choices[0].message.tool_calls[0].function
    # Six tokens short: inside the arguments or the call's closing text.
    cut_at = whole.usage.completion_tokens - 6
    r = client.chat.completions.create(model="default", max_tokens=cut_at, logprobs=True, **kwargs)
    generated = b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content).decode()
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content is None
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == full.name
    # Exactly what the model wrote: part of the whole call's arguments, nothing closed or added.
    assert full.arguments.startswith(call.function.arguments) and call.function.arguments in generated
    assert len(call.function.arguments) > len("{")
    streamed, finish = streamed_calls(client, max_tokens=cut_at, **kwargs)
    assert finish == "length"
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]


def test_a_conversation_with_tool_results_completes(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    r = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    first = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, temperature=0, max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # The call and its result are in the prompt: it is longer than the question alone by at least their text.
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 10


# -- logprobs, n, penalties --------------------------------------------------------------------


def test_logprobs_equal_a_log_softmax_of_transformers_logits(client, reference, token_ids_of):
    tok, model = reference
    messages = [{"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    ids, generated = prompt_ids(tok, messages), token_ids_of(content)
    logits = reference_logits(model, ids + generated)
    for i, entry in enumerate(content):
        expected = log_softmax(logits[len(ids) - 1 + i])
        assert entry.logprob <= 0 and all(t.logprob <= 0 for t in entry.top_logprobs)
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy: the largest
        assert entry.logprob == pytest.approx(expected[generated[i]], abs=2e-4)
        top_ids = token_ids_of(entry.top_logprobs)
        assert top_ids == list(np.argsort(-expected)[:3])
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], expected[top_ids], atol=2e-4)


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and logprob == pytest.approx(max(top.values()))
    echoed = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + r.choices[0].text


def test_echo_with_logprobs_gives_the_prompts_logprobs_from_transformers_logits(client, reference):
    tok, model = reference
    prompt = "The capital of France is"
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    for stream in (False, True):
        kwargs = dict(model="default", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
        if stream:
            tokens, token_logprobs, text = [], [], ""
            for chunk in client.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    text += choice.text
                    if choice.logprobs:
                        tokens += choice.logprobs.tokens
                        token_logprobs += choice.logprobs.token_logprobs
        else:
            r = client.completions.create(**kwargs)
            text, tokens, token_logprobs = r.choices[0].text, r.choices[0].logprobs.tokens, \
                r.choices[0].logprobs.token_logprobs
        assert text.startswith(prompt) and "".join(tokens) == text
        assert len(tokens) == len(ids) + 3 and token_logprobs[0] is None
        logits = reference_logits(model, ids)
        expected = [log_softmax(logits[p])[ids[p + 1]] for p in range(len(ids) - 1)]
        np.testing.assert_allclose(token_logprobs[1: len(ids)], expected, atol=2e-4)


def test_n_choices_draw_from_consecutive_seeds_and_share_the_prompt(client, server):
    messages = [{"role": "user", "content": "Write one line about a quiet harbour at dawn, " * 4}]
    before = prefix_hits(server)
    r = client.chat.completions.create(model="default", messages=messages, n=3, temperature=1.0, seed=40,
                                       max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):
        alone = client.chat.completions.create(model="default", messages=messages, temperature=1.0, seed=40 + i,
                                               max_tokens=12)
        assert choice.message.content == alone.choices[0].message.content
    # Choices 1 and 2 reused choice 0's full prompt pages (16 tokens each).
    full_pages = (r.usage.prompt_tokens - 1) // 16 * 16
    assert prefix_hits(server) - before >= 2 * full_pages > 0


def prefix_hits(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^jfire_prefix_cache_hit_tokens(?:_total)? (\S+)$", text, re.M).group(1))


def penalized_greedy(model, ids: list[int], steps: int, *, frequency=0.0, presence=0.0, repetition=1.0) -> list[int]:
    """OpenAI's formula (and HF's repetition penalty) on transformers' logits, greedy."""
    out = []
    for _ in range(steps):
        logits = reference_logits(model, ids + out)[-1]
        counts = np.bincount(np.array(out, dtype=np.int64), minlength=logits.shape[0])[: logits.shape[0]]
        logits = logits - counts * frequency - (counts > 0) * presence
        seen = (counts > 0) | (np.bincount(np.array(ids), minlength=logits.shape[0])[: logits.shape[0]] > 0)
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=1.2, presence_penalty=0.5),
                                       dict(repetition_penalty=1.5)], ids=["openai", "repetition"])
def test_penalties_give_the_reference_formulas_tokens(client, reference, token_ids_of, penalties):
    tok, model = reference
    messages = [{"role": "user", "content": "Say the word 'yes' twenty times."}]
    ids = prompt_ids(tok, messages)
    steps = 16
    plain = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=steps,
                                           logprobs=True)
    r = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=steps,
                                       logprobs=True, extra_body={"ignore_eos": True, **{
                                           k: v for k, v in penalties.items() if k == "repetition_penalty"}},
                                       **{k: v for k, v in penalties.items() if k != "repetition_penalty"})
    got = token_ids_of(r.choices[0].logprobs.content)
    expected = penalized_greedy(model, ids, steps, frequency=penalties.get("frequency_penalty", 0.0),
                                presence=penalties.get("presence_penalty", 0.0),
                                repetition=penalties.get("repetition_penalty", 1.0))
    assert got == expected
    assert r.choices[0].message.content != plain.choices[0].message.content  # the penalty changed the output


# -- bad combinations -------------------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"n": 17}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
], ids=["unknown-tool", "choice-without-tools", "invalid-schema", "schema-missing", "n-over-limit",
        "top-logprobs-alone", "top-logprobs-over-limit", "duplicate-tools", "penalty-range", "min-over-max"])
def test_bad_combinations_get_400_in_openais_shape(server, extra, param):
    body = {"model": "default", "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert param in (error["param"] or "") + error["message"], error
