"""One prefill process and one decode process (plus the frontend), launched for real with
`jfire launch meshes/local-1p1d.toml`: outputs equal colocated generation, the KV bytes moved
equal the prompts' cache size, and the faults a split deployment must survive."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import httpx
import pytest

from tests.disagg.clients import assert_same_as_colocated, client
from tests.disagg.conftest import PROMPTS
from tests.disagg.deployment_process import deployment_file, expected_kv_bytes, launch, metric

TRANSFER_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local-1p1d")
    running = launch(deployment_file(tmp, "local-1p1d", timeout_s=TRANSFER_TIMEOUT_S), tmp / "launch.log")
    yield running
    code = running.stop()
    assert code == 0, running.log.read_text()[-3000:]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_outputs_equal_colocated_and_kv_bytes_match_the_cache(deployment, colocated_reference):
    lengths = assert_same_as_colocated(deployment.url, PROMPTS, colocated_reference)
    expected = expected_kv_bytes(lengths)
    assert metric(deployment.url, "jfire_kv_transfer_bytes_total") == expected
    assert metric(deployment.url, "jfire_kv_transfers_total") == len(PROMPTS)
    decode, prefill = deployment.stats("decode"), deployment.stats("prefill")
    assert decode["kv_transfer_bytes"] == expected  # what the decode side actually pulled
    # Every transfer acknowledged, nothing held on either side.
    assert prefill["transfers_acknowledged"] == len(PROMPTS) and prefill["transfers_pending"] == 0
    # Acknowledgements are read between prefill steps, every 10-20 ms; the generous bounds here
    # and below absorb 3-4 JAX processes sharing a loaded 2-core machine, nothing more.
    assert _wait_for(lambda: deployment.stats("prefill")["pages_used"] == 0, 30, "prefill pages freed")
    assert deployment.stats("decode")["pages_used"] == 0


def test_prefill_and_decode_ran_in_different_processes(deployment):
    prefill, decode = deployment.group("prefill"), deployment.group("decode")
    pids = {prefill["pid"], decode["pid"], deployment.process.pid, os.getpid()}
    assert len(pids) == 4
    for group, process_id in ((prefill, 1), (decode, 2)):
        cmdline = open(f"/proc/{group['pid']}/cmdline", "rb").read().split(b"\0")
        assert cmdline[cmdline.index(b"--process-id") + 1] == str(process_id).encode()
    # Each side compiled only its own role's programs.
    assert deployment.stats("prefill")["transfers_published"] >= len(PROMPTS)
    assert "kv_transfer_bytes" not in deployment.stats("prefill")
    assert "transfers_published" not in deployment.stats("decode")


def test_a_transfer_never_pulled_is_released_after_its_timeout(deployment):
    control = deployment.group("prefill")["control"]
    body = {"request_id": "never-pulled", "prompt_ids": list(range(100, 140)),
            "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 1}, "shards": 1}
    answer = httpx.post(control + "/prefill", json=body, timeout=60).json()
    assert answer["transfer"]["num_pages"] == 3
    held = deployment.stats("prefill")
    assert held["transfers_pending"] == 1 and held["pages_used"] == 3
    released = _wait_for(lambda: (s := deployment.stats("prefill"))["transfers_pending"] == 0 and s,
                         TRANSFER_TIMEOUT_S + 5, "the transfer to expire")
    assert released["pages_used"] == 0 and released["transfers_expired"] == 1


def test_a_pull_that_never_arrives_fails_the_request_and_frees_its_pages(deployment):
    """The decode side's own deadline: the transfer server's pull of an id nobody publishes
    would wait for ever."""
    prefill = deployment.group("prefill")
    body = {"request_id": "never-published", "prompt_ids": list(range(100, 140)), "first_token": 5,
            "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 1},
            "transfer": {"address": prefill["transfer"], "uuid": random.getrandbits(62), "num_pages": 3,
                         "shards": 1, "group": "prefill-0", "bytes": 0}}
    t0 = time.time()
    with httpx.stream("POST", deployment.group("decode")["control"] + "/decode", json=body, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert time.time() - t0 < TRANSFER_TIMEOUT_S + 20  # its own deadline, not the transfer server's forever
    assert lines[-1]["finish_reason"] == "error" and "did not arrive within" in lines[-1]["error"]
    stats = deployment.stats("decode")
    assert stats["pages_used"] == 0 and stats["transfers_failed"] == 1


def test_killing_decode_mid_stream_fails_the_request_and_degrades_health(deployment):
    stream = client(deployment.url).completions.create(
        model="default", prompt="Count from one to one hundred:", max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    received = 0
    for _ in stream:
        received += 1
        if received == 3:
            break
    os.kill(deployment.group("decode")["pid"], signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(Exception) as failure:
        for _ in stream:
            pass
    assert time.time() - t0 < 30  # noticed at once (the stream breaks), not after a request timeout
    assert "decode group 'decode-0' stopped answering mid-stream" in str(failure.value)
    health = _wait_for(lambda: (r := httpx.get(deployment.url + "/health", timeout=5)).json()["status"] == "degraded"
                       and r, 30, "/health to say degraded")
    assert health.json()["groups"]["decode-0"]["alive"] is False and health.json()["groups"]["prefill-0"]["alive"]
    # The frontend is still up and says why new requests cannot be served.
    assert httpx.get(deployment.url + "/v1/models", timeout=5).status_code == 200
    r = httpx.post(deployment.url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 500 and "no decode group is up" in r.json()["error"]["message"]
