"""One prefill process and one decode process (plus the frontend), launched for real with
`jfire launch meshes/local-1p1d.toml --speculative suffix`: outputs equal colocated generation
(the decode group verifying drafts: the same tokens as decoding one at a time), the KV bytes
moved equal the prompts' cache size, and transfers that are never pulled or never arrive end
cleanly. The frontend requires API keys (one from --api-key-file, one from --api-key) and shows
its groups' addresses on /health only to a caller with one, or with the deployment's token.
(Processes killed mid-request: tests/reliability/test_disagg_faults.py.)"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil
import pytest

from jfire.disagg.launch import free_port
from jfire.disagg.transfer_auth import new_transfer_id, sign_transfer
from tests.disagg.clients import PROMPTS, assert_same_as_colocated
from tests.disagg.deployment_process import (
    REPO,
    assert_quiet,
    deployment_file,
    expected_kv_bytes,
    launch,
    metric,
    wait_for,
)
from tests.limits import serve_engine_config
from tests.listening_sockets import listening

TRANSFER_TIMEOUT_S = 4
FILE_KEY, ARGV_KEY = "split-key-from-the-file", "split-key-from-argv"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local-1p1d")
    running = launch(deployment_file(tmp, "local-1p1d", timeout_s=TRANSFER_TIMEOUT_S), tmp / "launch.log",
                     extra=("--speculative", "suffix", "--num-draft-tokens", "1", "--api-key", ARGV_KEY),
                     api_keys=(FILE_KEY,))
    yield running
    code = running.stop()
    assert code == 0, running.log.read_text()[-3000:]
    assert_quiet(running.log)


def test_outputs_equal_colocated_and_kv_bytes_match_the_cache(deployment, colocated_reference):
    # Counted from here: the module's other tests may have run first.
    bytes_before, transfers_before = (metric(deployment.url, "jfire_kv_transfer_bytes_total", deployment.auth),
                                      metric(deployment.url, "jfire_kv_transfers_total", deployment.auth))
    decode_before, prefill_before = deployment.stats("decode"), deployment.stats("prefill")
    lengths = assert_same_as_colocated(deployment.url, PROMPTS, colocated_reference, extra_headers=deployment.auth)
    expected = expected_kv_bytes(lengths)
    assert metric(deployment.url, "jfire_kv_transfer_bytes_total", deployment.auth) - bytes_before == expected
    assert metric(deployment.url, "jfire_kv_transfers_total", deployment.auth) - transfers_before == len(PROMPTS)
    decode, prefill = deployment.stats("decode"), deployment.stats("prefill")
    # What the decode side actually pulled.
    assert decode["kv_transfer_bytes"] - decode_before["kv_transfer_bytes"] == expected
    # Every transfer acknowledged, nothing held on either side.
    assert prefill["transfers_acknowledged"] - prefill_before["transfers_acknowledged"] == len(PROMPTS)
    assert prefill["transfers_pending"] == 0
    # Acknowledgements are read between prefill steps, every 10-20 ms; the generous bounds here
    # and below absorb 3-4 JAX processes sharing a loaded 2-core machine, nothing more.
    assert wait_for(lambda: deployment.stats("prefill")["pages_used"] == 0, 30, "prefill pages freed")
    assert deployment.stats("decode")["pages_used"] == 0


def test_prefill_and_decode_ran_in_different_processes(deployment):
    prefill, decode = deployment.group("prefill"), deployment.group("decode")
    pids = {prefill["pid"], decode["pid"], deployment.process.pid, os.getpid()}
    assert len(pids) == 4
    for group, process_id in ((prefill, 1), (decode, 2)):
        cmdline = open(f"/proc/{group['pid']}/cmdline", "rb").read().split(b"\0")
        assert cmdline[cmdline.index(b"--process-id") + 1] == str(process_id).encode()
    # Each side compiled only its own role's programs.
    assert "transfers_published" in deployment.stats("prefill")
    assert "kv_transfer_bytes" not in deployment.stats("prefill")
    assert "transfers_published" not in deployment.stats("decode")


def test_the_frontend_requires_a_key_from_argv_or_the_file_and_gets_it_by_environment(deployment):
    """`launch --api-key KEY --api-key-file PATH`: 401 without a key or with a wrong one, 200
    with either key; the frontend process has KEY in its environment, not on its command line,
    and the groups have it in neither."""
    ask = {"model": "default", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {FILE_KEY}x"}):
        r = httpx.post(deployment.url + "/v1/completions", json=ask, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
    for key in (FILE_KEY, ARGV_KEY):
        r = httpx.post(deployment.url + "/v1/completions", json=ask, headers={"Authorization": f"Bearer {key}"},
                       timeout=300)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    pids = dict(re.findall(r"^jfire: launch: process (\d+) .*: pid (\d+)$", deployment.log.read_text(), re.M))
    for process_id, pid in pids.items():
        argv = open(f"/proc/{pid}/cmdline", "rb").read()
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert ARGV_KEY.encode() not in argv and (f"JFIRE_API_KEY={ARGV_KEY}".encode() in environ) == (
            process_id == "0"), process_id
    frontend_argv = open(f"/proc/{pids['0']}/cmdline", "rb").read().split(b"\0")
    assert frontend_argv[frontend_argv.index(b"--api-key-file") + 1].endswith(b"api-keys")


def test_health_shows_group_addresses_only_to_a_key_or_the_deployment_token(deployment):
    public = httpx.get(deployment.url + "/health", timeout=10).json()
    assert public["status"] == "ok"
    assert public["groups"] == {name: {"role": g["role"], "alive": g["alive"]}
                                for name, g in deployment.health["groups"].items()}
    for headers in (deployment.auth, deployment.control_auth):
        groups = httpx.get(deployment.url + "/health", headers=headers, timeout=10).json()["groups"]
        assert {g["pid"] for g in groups.values()} == {g["pid"] for g in deployment.health["groups"].values()}
        assert all(g["control"].startswith("http://127.0.0.1:") for g in groups.values())


def security_doc_listeners() -> list[dict]:
    """docs/security.md's table of listeners, a dict per row keyed by its header."""
    lines = [line for line in (REPO / "docs" / "security.md").read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]


def test_every_listening_socket_is_in_the_security_docs_table(deployment):
    """Each process of the launch listens on 127.0.0.1 only (the table's default bind for a
    local launch), and on as many sockets as the table gives its kind of process: nothing
    listens that docs/security.md does not name."""
    sockets_of = collections.Counter()
    for row in security_doc_listeners():
        sockets_of[row["process"]] += int(row["sockets"])
    expected = {"frontend": sockets_of["frontend"],  # groups of one process: no spanning-group sockets
                "group": sockets_of["group leader"] + sockets_of["group process"]}
    children = [p for p in psutil.Process(deployment.process.pid).children(recursive=True)
                if "--process-id" in p.cmdline()]
    assert len(children) == 3
    controls = {int(g["control"].rsplit(":", 1)[1]) for g in deployment.health["groups"].values()}
    for child in children:
        argv = child.cmdline()
        kind = "frontend" if argv[argv.index("--process-id") + 1] == "0" else "group"
        sockets = listening(child.pid)
        assert {address for address, _ in sockets} == {"127.0.0.1"}, (kind, sockets)
        assert len(sockets) == expected[kind], (kind, sockets, expected)
        ports = {port for _, port in sockets}
        if kind == "frontend":
            assert int(deployment.url.rsplit(":", 1)[1]) in ports
        else:
            assert len(ports & controls) == 1


def test_cache_salts_reach_the_prefill_group(deployment):
    """A prompt's salt travels with it to the prefill group, whose cache it keys: the same salt
    finds the prompt's blocks, another salt (or none) finds nothing, and the output is the same."""
    prompt = list(range(2000, 2040))  # two full pages of 16 and 8 tokens more

    def ask(**salt) -> tuple[str, int]:
        body = {"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0, **salt}
        r = httpx.post(deployment.url + "/v1/completions", json=body, headers=deployment.auth, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    text, cached = ask(cache_salt="tenant-a")
    assert cached == 0
    assert ask(cache_salt="tenant-a") == (text, 32)
    assert ask(cache_salt="tenant-b") == (text, 0)
    assert ask() == (text, 0)


def test_the_ready_lines_count_every_program_and_the_time_since_launch(deployment):
    """Each group's ready line counts the programs it compiled before serving, its KV transfer
    programs included (they compile first, inside the same clock), and the launcher's line
    the time from launch to the frontend's /health answering 200."""
    from jfire.disagg.kv_transfer import transfer_widths
    from tests.limits import DEPLOYMENT_LIMITS

    log = deployment.log.read_text()
    context = int(DEPLOYMENT_LIMITS[DEPLOYMENT_LIMITS.index("--max-context") + 1])
    widths = len(transfer_widths(-(-context // 16), 16))
    for label, role, essential in (("prefill-0/0", "prefill", 2), ("decode-0/0", "decode", 1)):
        line = re.search(rf"^jfire: {label}: ready \({role}, mesh single, (\d+) programs compiled in ([\d.]+) s, "
                         rf"([\d.]+) s after launch\)", log, re.M)
        assert line, log[-3000:]
        assert int(line.group(1)) >= widths + essential  # the transfer's widths, then at least the essential ones
        assert float(line.group(2)) <= float(line.group(3))
    assert re.search(r"^jfire: launch: local-1p1d: ready, [\d.]+ s after launch", log, re.M), log[-3000:]


def test_a_transfer_never_pulled_is_released_after_its_timeout(deployment):
    control = deployment.group("prefill")["control"]
    expired_before = deployment.stats("prefill")["transfers_expired"]
    body = {"request_id": "never-pulled", "prompt_ids": list(range(100, 140)),
            "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 1}, "shards": 1}
    answer = httpx.post(control + "/prefill", json=body, headers=deployment.control_auth, timeout=60).json()
    assert answer["transfer"]["num_pages"] == 3
    held = deployment.stats("prefill")
    assert held["transfers_pending"] == 1 and held["pages_used"] == 3
    released = wait_for(lambda: (s := deployment.stats("prefill"))["transfers_pending"] == 0 and s,
                         TRANSFER_TIMEOUT_S + 5, "the transfer to expire")
    assert released["pages_used"] == 0 and released["transfers_expired"] == expired_before + 1


def test_a_request_waiting_for_decode_pages_outlasts_the_transfer_timeout(deployment, colocated_reference):
    """The decode pool is full with one long request, so the next one waits there for pages
    longer than the transfer timeout: the decode group keeps renewing it, the prefill group
    keeps its cache, and it completes exactly as colocated generation, with nothing expired."""
    before = deployment.stats("prefill")
    pages_total = deployment.stats("decode")["pages_total"]
    # Its pages (prompt and every token it may generate, taken when it starts decoding) leave
    # less than one free: the short request below needs two. A long prompt and 160 tokens to
    # decode: several times the transfer timeout of decoding still to go when the short one comes.
    # Random tokens, sampled at temperature 1: an answer that copies nothing, so the decode group's
    # drafts fail and it decodes about one token a step, as slowly as this test needs.
    decoded = 160
    prompt = [int(x) for x in np.random.RandomState(3).randint(1000, 40000, size=pages_total * 16 - 8 - decoded)]
    long_body = {"model": "default", "prompt": prompt, "max_tokens": decoded, "temperature": 1.0, "seed": 3,
                 "ignore_eos": True, "stream": True}
    with httpx.stream("POST", deployment.url + "/v1/completions", json=long_body, headers=deployment.auth,
                      timeout=120) as long_stream:
        lines = long_stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # decoding: its pages are taken
        assert deployment.stats("decode")["pages_free"] < 2
        # Waits for pages until the long request ends, far longer than the timeout.
        assert_same_as_colocated(deployment.url, PROMPTS[:1], colocated_reference[:1], extra_headers=deployment.auth)
        assert [line for line in lines if line][-1] == "data: [DONE]"
    after = deployment.stats("prefill")
    assert after["transfers_expired"] == before["transfers_expired"]
    assert after["transfers_renewed"] > before["transfers_renewed"]


def _pull_from(deployment, request_id: str, address: str) -> list[dict]:
    """A transfer the prefill group never published, described (and signed with the
    deployment's secret) as one of its own."""
    transfer = {"address": address, "uuid": random.getrandbits(62), "id": new_transfer_id(), "num_pages": 3,
                "pages": [0, 1, 2], "shards": 1, "group": "prefill-0", "bytes": 0, "raw_bytes": 0, "checksum": 0}
    body = {"request_id": request_id, "prompt_ids": list(range(100, 140)), "first_token": 5,
            "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 1},
            "transfer": sign_transfer(deployment.secret, transfer)}
    with httpx.stream("POST", deployment.group("decode")["control"] + "/decode", json=body,
                      headers=deployment.control_auth, timeout=60) as r:
        return [json.loads(line) for line in r.iter_lines() if line]


def test_a_pull_that_never_arrives_fails_the_request_frees_its_pages_and_its_thread(deployment):
    """The decode side's own deadline: a live sender that never publishes this id. The
    transfer server's pull alone would wait for ever; the request fails at the deadline, its
    pages are freed and the pull thread ends."""
    failed_before = deployment.stats("decode")["transfers_failed"]
    t0 = time.time()
    lines = _pull_from(deployment, "never-published", deployment.group("prefill")["transfer"])
    assert time.time() - t0 < TRANSFER_TIMEOUT_S + 20  # its own deadline, not the transfer server's forever
    assert lines[-1]["finish_reason"] == "error" and "did not arrive within" in lines[-1]["error"]
    stats = deployment.stats("decode")
    assert stats["pages_used"] == 0 and stats["transfers_failed"] == failed_before + 1
    # The thread ends too: the prefill group, told the pull was given up, answered it with zeros.
    assert wait_for(lambda: deployment.stats("decode")["pull_threads"] == 0, 20, "the pull thread to end")
    assert deployment.stats("prefill")["pulls_abandoned"] >= 1


def test_a_pull_from_a_sender_that_is_gone_fails_at_once(deployment):
    """Nothing listens at the address (the prefill process died before the pull began)."""
    failed_before = deployment.stats("decode")["transfers_failed"]
    lines = _pull_from(deployment, "sender-gone", f"127.0.0.1:{free_port()}")
    assert lines[-1]["finish_reason"] == "error" and "not answering" in lines[-1]["error"]
    stats = deployment.stats("decode")
    assert stats["pages_used"] == 0 and stats["transfers_failed"] == failed_before + 1
    assert wait_for(lambda: deployment.stats("decode")["pull_threads"] == 0, 20, "the pull thread to end")


# A client with six long prompts in flight at once, killed while they wait for prefill.
QUEUEING_CLIENT = """
import os, sys, threading, httpx
def ask(i):
    prompt = [1000 + 37 * i + j for j in range(380)]  # 24 of the group's 29 pages: one prompt at a time
    httpx.post(sys.argv[1] + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 4},
               headers={"Authorization": "Bearer " + os.environ["API_KEY"]}, timeout=300)
for i in range(6):
    threading.Thread(target=ask, args=(i,)).start()
"""


def test_a_client_killed_with_prompts_queued_is_dropped_by_the_prefill_group_within_a_second(deployment):
    # A step is short once every program is compiled (the first ones may still be compiling
    # after start-up, and a step waiting for one would hold the cancellation up).
    wait_for(lambda: not deployment.stats("prefill")["compiling"], 300, "the prefill group's programs")
    before = deployment.stats("prefill")
    client = subprocess.Popen([sys.executable, "-c", QUEUEING_CLIENT, deployment.url],
                              env={**os.environ, "API_KEY": FILE_KEY})
    try:
        held = lambda s: s["running"] + s["waiting"]  # noqa: E731
        wait_for(lambda: held(deployment.stats("prefill")) == 6, 60, "six prompts at the prefill group")
    finally:
        client.kill()
    killed = time.monotonic()
    after = wait_for(lambda: (s := deployment.stats("prefill")) and held(s) == 0 and s, 30,
                     "the prefill group to drop them")
    dropped_after_s = time.monotonic() - killed
    # A cancel takes effect between two engine steps: within a second, plus the step the group
    # was in (its mean step here; on a loaded machine a step takes longer).
    steps = max(1, after["steps"] - before["steps"])
    step_s = sum(after[k] - before[k] for k in ("step_prepare_s", "step_device_s")) / steps
    assert dropped_after_s < 1.0 + step_s, \
        f"the prefill group held the departed client's prompts {dropped_after_s:.2f} s (its steps take {step_s:.2f} s)"
    published_before = before["transfers_published"]
    # At most the prompt running when the client died was published; nothing stays held.
    assert deployment.stats("prefill")["transfers_published"] - published_before <= 1
    assert wait_for(lambda: deployment.stats("prefill")["pages_used"] == 0, TRANSFER_TIMEOUT_S + 10, "pages freed")
    client.wait()


# The agents' options through the split deployment against the same requests served colocated
# in this process (the same HTTP app over one engine): the prefill group masks, penalizes and
# scores the first token, the decode group the rest.
AGENT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["name", "age"], "additionalProperties": False}
AGENT_REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 40,
                              "temperature": 0.9, "seed": 3, "logprobs": True, "top_logprobs": 2,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "p", "schema": AGENT_SCHEMA}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say yes many times."}], "max_tokens": 12,
                              "temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 40,
                              "temperature": 0, "tool_choice": "required", "tools": [{"type": "function", "function": {
                                  "name": "get_weather", "parameters": {"type": "object", "properties": {
                                      "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                                      "additionalProperties": False}}}]}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2,
                         "echo": True}),
]


@pytest.fixture(scope="module")
def colocated_app():
    from fastapi.testclient import TestClient

    from jfire.checkpoint.load import load_model
    from jfire.engine import Engine
    from serve.app import ServerState, create_app

    engine = Engine(load_model("default", "float32"), serve_engine_config(aot=False)).start()
    with TestClient(create_app(ServerState(engine, "default"))) as http:
        yield http
    engine.shutdown()


def _assert_same(split, local, where="choices"):
    """Equal outputs; logprobs within 1e-4 (the two sides chunk prompts differently, which
    moves float32 logits in their last bits). Tool call ids are random."""
    if isinstance(split, float) and isinstance(local, float):
        assert abs(split - local) <= 1e-4, (where, split, local)
    elif isinstance(split, dict) and isinstance(local, dict):
        assert split.keys() == local.keys(), where
        for key in split:
            if key != "id":
                _assert_same(split[key], local[key], f"{where}.{key}")
    elif isinstance(split, list) and isinstance(local, list):
        assert len(split) == len(local), where
        for i, (a, b) in enumerate(zip(split, local)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert split == local, (where, split, local)


COPY = ("/v1/chat/completions", {"messages": [{"role": "user", "content": (
    "Rename the class Point to Vector in this code and output the full code:\n\n```python\nclass Point:\n"
    "    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n```")}], "max_tokens": 48,
    "temperature": 0, "logprobs": True, "top_logprobs": 2})


def test_the_decode_side_verifies_drafts_and_equals_colocated(deployment, colocated_app):
    """An answer that copies its prompt: the decode group verifies drafts (its stats count them)
    and the output, logprobs included, is the colocated engine's without speculation."""
    before = deployment.stats("decode")["spec_draft_tokens"]
    path, body = COPY
    split = httpx.post(deployment.url + path, json={"model": "default", **body}, headers=deployment.auth, timeout=300)
    local = colocated_app.post(path, json={"model": "default", **body})
    assert split.status_code == local.status_code == 200, (split.text, local.text)
    _assert_same(split.json()["choices"], local.json()["choices"])
    decode = deployment.stats("decode")
    assert decode["spec_draft_tokens"] > before and decode["spec_accepted_tokens"] > 0
    assert "spec_draft_tokens" not in deployment.stats("prefill")  # the prefill group decodes nothing


@pytest.mark.parametrize("index", range(len(AGENT_REQUESTS)), ids=["schema-logprobs", "penalties-n2", "tool", "echo"])
def test_agent_options_through_the_deployment_equal_colocated(deployment, colocated_app, index):
    path, body = AGENT_REQUESTS[index]
    body = {"model": "default", **body}
    split = httpx.post(deployment.url + path, json=body, headers=deployment.auth, timeout=300)
    local = colocated_app.post(path, json=body)
    assert split.status_code == local.status_code == 200, (split.text, local.text)
    _assert_same(split.json()["choices"], local.json()["choices"])
