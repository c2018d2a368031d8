"""A real `jfire serve` (uvicorn on a loopback port, the default model) talked to with the
official openai client: results equal `jfire generate`, streaming equals non-streaming,
concurrent streams are independent, a disconnect frees its pages, bad input gets 400s."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.limits import SERVE_LIMITS
from tests.serve.server_process import start_server

API_KEY = "test-key-123"
SERVER_ARGS = [*SERVE_LIMITS, "--api-key", API_KEY, "--compile-cache", "off"]


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    srv = start_server(SERVER_ARGS, tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def jfire_generate(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "jfire.cli", "generate", "--json", *args],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def test_health_is_not_ready_until_programs_are_compiled(server):
    """503 until the essential programs exist, then 200 while the rest compile in the
    background (reporting their progress), then 200 with every program compiled."""
    assert 503 in server.health_seen, "the server answered before compiling: /health was never 'starting'"
    assert server.health_seen[-1] == 200
    first = server.health_seen.index(503)
    assert all(s == 503 for s in server.health_seen[first:-1])
    deadline = time.monotonic() + 600  # the background compilation of the remaining programs
    # A generous read timeout: the background compilation shares two loaded cores with this poll.
    while (body := httpx.get(server.url + "/health", timeout=60).json())["compiling"]:  # no key needed
        assert body["status"] == "ok" and 0 < body["programs"]["compiled"] < body["programs"]["total"]
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    assert body["status"] == "ok" and body["programs"]["compiled"] == body["programs"]["total"] > 2


def test_every_endpoint_but_health_needs_the_key(server):
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models", headers=auth()).json()["data"][0]["id"] == "default"


def test_completion_equals_jfire_generate(client):
    prompt = "The three primary colours are"
    got = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    want = jfire_generate("--prompt", prompt, "--max-tokens", "24")
    assert got.choices[0].text == want["text"]
    assert got.usage.prompt_tokens == len(want["prompt_ids"])
    assert got.usage.completion_tokens == len(want["token_ids"])
    assert got.choices[0].finish_reason == {"length": "length", "stop": "stop"}[want["finish_reason"]]


def test_chat_completion_equals_jfire_generate(client):
    question = "Name a planet in the solar system."
    got = client.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                         max_tokens=24, temperature=0)
    want = jfire_generate("--chat", question, "--max-tokens", "24")
    assert got.choices[0].message.content == want["text"]
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want["prompt_ids"])


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model="default", max_tokens=20, temperature=0)
    whole = client.completions.create(prompt="Once upon a time", **kwargs)
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Write one sentence about rain."}]
    whole = client.chat.completions.create(messages=messages, **kwargs)
    stream = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content


def test_stop_strings_and_seeds(client):
    text = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=30, temperature=0).choices[0].text
    stop = text.strip()[:2]
    cut = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    sampled = [client.completions.create(model="default", prompt="My favourite animal is", max_tokens=16,
                                         temperature=1.0, top_p=0.9, seed=1234).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_sixteen_concurrent_streaming_clients(client):
    prompts = [f"Tell me a fact about the number {i}." for i in range(16)]
    alone = [client.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                            max_tokens=8, temperature=0).choices[0].message.content
             for p in prompts]

    def stream(prompt: str) -> str:
        own = openai.OpenAI(base_url=client.base_url, api_key=API_KEY, max_retries=0, timeout=300)
        parts = own.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=8, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in parts)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(stream, prompts))
    assert together == alone
    assert len(set(together)) > 1  # independent outputs, not one stream copied


def test_client_disconnect_frees_pages_promptly(server):
    body = {"model": "default", "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=auth()) as r:
            lines = r.iter_lines()
            received = 0
            for line in lines:
                if line.startswith("data: "):
                    received += 1
                if received == 3:
                    break
            assert metric(server, "jfire_kv_pages_used") > 0
    # The connection is closed here, mid-stream. The server notices at the stream's next write,
    # one engine step (~60 ms) later; the 10 s bound only absorbs a loaded 2-core machine.
    deadline = time.time() + 10.0
    while time.time() < deadline and metric(server, "jfire_kv_pages_used") != 0:
        time.sleep(0.05)
    assert metric(server, "jfire_kv_pages_used") == 0
    assert metric(server, "jfire_requests_running") == 0


def test_non_streaming_client_that_leaves_is_cancelled(server):
    """A client that gives up on a non-streaming completion (nothing is written until the end)
    cancels it: its pages are freed long before its 400 tokens would have been generated."""
    before = metric(server, "jfire_generation_tokens_total")
    body = {"model": "default", "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(60, read=2.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(server.url + "/v1/completions", json=body, headers=auth())
    # The connection closed with the client. The server checks every 0.25 s; 400 tokens take
    # over 20 s here, and the 10 s bound only absorbs a loaded 2-core machine.
    deadline = time.time() + 10.0
    while time.time() < deadline and metric(server, "jfire_kv_pages_used") != 0:
        time.sleep(0.05)
    assert metric(server, "jfire_kv_pages_used") == 0
    assert metric(server, "jfire_requests_running") == 0
    assert metric(server, "jfire_generation_tokens_total") - before < 400  # cancelled, not finished


BAD_INPUTS = {
    "malformed_json": (b"{not json", None),
    "missing_model": ({"prompt": "hi"}, "model"),
    "missing_prompt": ({"model": "default"}, "prompt"),
    "prompt_wrong_type": ({"model": "default", "prompt": 12}, "prompt"),
    "max_tokens_wrong_type": ({"model": "default", "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    "unknown_model": ({"model": "gpt-9", "prompt": "hi"}, "model"),
    "prompt_longer_than_context": ({"model": "default", "prompt": [5] * 600}, "prompt"),
    "max_tokens_past_context": ({"model": "default", "prompt": "hi", "max_tokens": 600}, "max_tokens"),
    "negative_temperature": ({"model": "default", "prompt": "hi", "temperature": -1}, "temperature"),
    "top_p_above_one": ({"model": "default", "prompt": "hi", "top_p": 2}, "top_p"),
    "negative_top_k": ({"model": "default", "prompt": "hi", "top_k": -3}, "top_k"),
    "n_above_limit": ({"model": "default", "prompt": "hi", "n": 17}, "n"),
    "too_many_stops": ({"model": "default", "prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    "token_outside_vocabulary": ({"model": "default", "prompt": [1, 10 ** 7]}, "prompt"),
    "several_prompts": ({"model": "default", "prompt": ["a", "b"]}, "prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_a_400_in_openai_shape(server, case):
    body, param = BAD_INPUTS[case]
    kwargs = {"content": body, "headers": {**auth(), "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": auth()}
    r = httpx.post(server.url + "/v1/completions", timeout=60, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_chat_bad_inputs(server):
    for body in ({"model": "default", "messages": []},
                 {"model": "default", "messages": [{"role": "wizard", "content": "hi"}]},
                 {"model": "default", "messages": "hello"},
                 {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(), timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/nothing", headers=auth())
    assert r.status_code == 404 and "error" in r.json()


def test_chat_with_image_parts_is_refused_clearly(server):
    parts = [{"type": "text", "text": "What is in this picture?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(), timeout=60,
                   json={"model": "default", "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "image content parts are not supported" in error["message"]


def test_metrics_count_requests_latency_and_tokens(server, client):
    client.completions.create(model="default", prompt="Count: one, two,", max_tokens=8, temperature=0)
    refused = httpx.post(server.url + "/v1/completions", headers=auth(), json={"model": "default", "prompt": "x",
                                                                               "temperature": 5})
    assert refused.status_code == 400
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    assert re.search(r'^jfire_requests_total\{endpoint="completions",status="200"\} [1-9]', text, re.M)
    assert re.search(r'^jfire_requests_total\{endpoint="completions",status="400"\} [1-9]', text, re.M)
    assert metric(server, "jfire_time_to_first_token_seconds_count") >= 1
    assert metric(server, "jfire_time_per_output_token_seconds_count") >= 1
    assert metric(server, "jfire_generation_tokens_total") >= 8
    assert metric(server, "jfire_kv_pages_total") == metric(server, "jfire_kv_pages_used") + metric(
        server, "jfire_kv_pages_free")


def access_lines(server) -> list[str]:
    return [line for line in server.log.read_text().splitlines() if line.startswith("jfire: access: ")]


def access_line_of(server, request_id: str) -> dict:
    """The fields of the access line ending with id=request_id (written once the response has gone)."""
    deadline = time.time() + 10
    while time.time() < deadline:
        for line in access_lines(server):
            if line.endswith(f" id={request_id}"):
                head, _, rest = line.partition('" ')
                status, *fields = rest.split()
                return {"request": head.split('"')[1], "status": int(status),
                        **dict(f.split("=", 1) for f in fields)}
        time.sleep(0.1)
    raise AssertionError(f"no access line for {request_id}:\n" + "\n".join(access_lines(server)[-10:]))


def test_the_access_log_has_one_line_per_request(server):
    """The README's curl example, sent to this server, and a stream and a bad request: one line
    each with what the responses themselves say; /health (polled while starting) has none."""
    from tests.test_readme import ALL

    curl = next(c for _, c, _ in ALL if c.startswith("curl "))
    curl = curl.replace("http://127.0.0.1:8000", server.url) + f" -H 'Authorization: Bearer {API_KEY}'"
    answer = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, check=True).stdout)
    line = access_line_of(server, answer["id"])
    assert line["request"] == "POST /v1/chat/completions" and line["status"] == 200
    assert int(line["prompt_tokens"]) == answer["usage"]["prompt_tokens"]
    assert int(line["completion_tokens"]) == answer["usage"]["completion_tokens"]
    assert line["finish"] == answer["choices"][0]["finish_reason"]
    assert 0 < float(line["ttft"].rstrip("s")) <= float(line["total"].rstrip("s"))

    body = {"model": "default", "prompt": "The sea", "max_tokens": 5, "stream": True, "n": 2, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(), timeout=120) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    line = access_line_of(server, chunks[0]["id"])
    assert line["request"] == "POST /v1/completions" and line["status"] == 200
    assert line["completion_tokens"] == "10" and line["finish"] == "length"

    refused_before = sum('"POST /v1/completions" 400 ' in x for x in access_lines(server))
    bad = httpx.post(server.url + "/v1/completions", json={"model": "default", "prompt": "x", "temperature": -1},
                     headers=auth(), timeout=30)
    assert bad.status_code == 400
    time.sleep(0.5)
    assert sum('"POST /v1/completions" 400 ' in x for x in access_lines(server)) == refused_before + 1
    assert server.health_seen and not any("/health" in x or "/metrics" in x for x in access_lines(server))


def test_health_answers_while_a_large_schema_compiles(server):
    """A 200 KB JSON schema (1,250 properties, each one of three kinds) takes llguidance about
    0.4 s to compile for the default model's vocabulary. Compiled on the event loop, twice for
    each of n = 16 choices, it held every other client up for 12 s; compiled once, in the
    grammar pool, /health answers while the request is still on its way."""
    properties = {f"field_{i}": {"anyOf": [{"type": "integer", "minimum": i}, {"type": "string", "maxLength": i % 50 + 1},
                                           {"type": "array", "items": {"type": "number"}}]} for i in range(1250)}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    body = {"model": "default", "prompt": "Fill in the form:", "max_tokens": 3, "n": 16, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}}
    assert len(json.dumps(body)) > 200_000
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        pending = pool.submit(httpx.post, server.url + "/v1/completions", json=body, headers=auth(), timeout=300)
        time.sleep(0.4)  # sent and read; its grammar is compiling
        t0 = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=60)
        waited, pending_then = time.monotonic() - t0, not pending.done()
        answer = pending.result()
        took = time.monotonic() - started
    assert health.status_code == 200 and pending_then
    # Within a second, or on a loaded machine a small part of the request's own time (held up,
    # /health waited for most of it).
    assert waited < max(1.0, took / 4), (waited, took)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 16
