"""Prefill and decode on different meshes (meshes/local-1p1d-mixed.toml: prefill tensor-parallel
over 3 devices, decode a 2-stage pipeline): the KV cache is resharded on the way and outputs
still equal colocated generation. Then the prefill process dies before publishing."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.disagg.clients import ask, assert_same_as_colocated
from tests.disagg.conftest import PROMPTS
from tests.disagg.deployment_process import deployment_file, expected_kv_bytes, launch, metric


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local-1p1d-mixed")
    running = launch(deployment_file(tmp, "local-1p1d-mixed", timeout_s=10), tmp / "launch.log")
    yield running
    code = running.stop()
    assert code == 0, running.log.read_text()[-3000:]


def test_different_meshes_equal_colocated(deployment, colocated_reference):
    prefill, decode = deployment.group("prefill"), deployment.group("decode")
    assert (prefill["mesh"], prefill["devices"], decode["mesh"], decode["devices"]) == ("tp=3", 3, "pp=2", 2)
    lengths = assert_same_as_colocated(deployment.url, PROMPTS, colocated_reference)
    expected = expected_kv_bytes(lengths)
    assert metric(deployment.url, "jfire_kv_transfer_bytes_total") == expected
    assert deployment.stats("decode")["kv_transfer_bytes"] == expected


def test_killing_prefill_before_it_publishes_fails_the_request(deployment):
    pid = deployment.group("prefill")["pid"]
    # Frozen first, so the request is certainly waiting on a prefill that never publishes.
    os.kill(pid, signal.SIGSTOP)
    result: dict = {}

    def request():
        try:
            ask(deployment.url, {"prompt": "Tell me about the ocean.", "max_tokens": 8})
        except Exception as e:  # noqa: BLE001 - the assertion below checks what it was
            result["error"] = e
        result["at"] = time.time()

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive()
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=10)
    assert not thread.is_alive(), "the request hung after its prefill group died"
    assert result["at"] - killed_at < 5
    assert "prefill group 'prefill-0' failed before publishing" in str(result["error"])
    health = httpx.get(deployment.url + "/health", timeout=5)
    assert health.json()["status"] == "degraded" and health.json()["groups"]["prefill-0"]["alive"] is False
    # The decode group holds nothing for the failed request.
    assert deployment.stats("decode")["pages_used"] == 0
