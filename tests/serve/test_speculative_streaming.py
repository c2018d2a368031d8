"""Speculation through the OpenAI API: a `jfire serve --speculative suffix` of the default model
streams the same text, the same tool calls and the same schema-valid structured outputs as a
plain `jfire serve`, chunk joins and all, and reports its drafts on /metrics. Two tokens a step
(one draft, so three verify programs to compile beside the server's others) pass through the
detokenizer, stop strings, the grammar matcher and the tool-call parser exactly as one token a
step would; usage counts stay right."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.limits import SERVE_LIMITS
from tests.serve.server_process import start_server
from tests.serve.test_agent_api import ASK, PERSON, TOOLS

CODE = '''class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):
        return f"Point({self.x}, {self.y})"\n'''
EDIT = [{"role": "user", "content": f"Rename the class Point to Vector in this code and output the full code:\n\n"
                                     f"```python\n{CODE}```"}]


@pytest.fixture(scope="module")
def clients(default_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("speculative")
    servers = [start_server(SERVE_LIMITS, log / "plain.log"),
               start_server([*SERVE_LIMITS, "--speculative", "suffix", "--num-draft-tokens", "1"],
                            log / "speculative.log")]
    try:
        yield [openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300) for s in servers], \
            servers[1]
    finally:
        for s in servers:
            s.stop()


def streamed(client, **kwargs) -> dict:
    """What a client assembles from a streamed chat completion: the content, the tool calls,
    the finish reason, the usage, and how many content chunks carried text."""
    content, calls, finish, usage, chunks = "", {}, None, None, 0
    for chunk in client.chat.completions.create(model="default", stream=True, stream_options={"include_usage": True},
                                                **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            if choice.delta.content:
                content += choice.delta.content
                chunks += 1
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish,
            "usage": (usage.prompt_tokens, usage.completion_tokens), "chunks": chunks}


def both(clients, **kwargs) -> dict:
    (plain, speculative), _ = clients
    want, got = streamed(plain, **kwargs), streamed(speculative, **kwargs)
    assert got == want
    return got


def test_a_copying_answer_streams_the_same_text(clients):
    got = both(clients, messages=EDIT, temperature=0, max_tokens=96, stop=["__repr__"])
    assert "class Point" in got["content"] and got["finish"] == "stop"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_stream_the_same_calls(clients, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    got = both(clients, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
               temperature=0, max_tokens=80)
    assert got["finish"] == "tool_calls" and got["calls"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in got["calls"]:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_structured_output_streams_the_same_valid_document(clients):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Describe a person called Ada who likes green, as JSON."}]
    got = both(clients, messages=messages, response_format=fmt, temperature=0, max_tokens=120)
    jsonschema.validate(json.loads(got["content"]), PERSON)


def test_drafts_were_verified_and_reported(clients):
    _, server = clients
    metrics = httpx.get(server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("jfire_spec_") and not line.startswith("#")}
    assert values["jfire_spec_draft_tokens_total"] > 0
    assert 0 < values["jfire_spec_accepted_tokens_total"] <= values["jfire_spec_draft_tokens_total"]
    assert values["jfire_spec_mean_accepted_length"] > 1
