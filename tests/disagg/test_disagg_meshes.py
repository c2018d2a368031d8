"""Prefill and decode on different meshes, with two prefill groups: prefill-0 tensor-parallel
over 3 devices, prefill-1 on one device, decode-0 a 2-stage pipeline on 2 devices. The KV
cache is resharded on the way and outputs still equal colocated generation; a session key
keeps a conversation on one prefill group (its prefix cache hits)."""

from __future__ import annotations

import httpx
import pytest

from tests.disagg.clients import PROMPTS, ask, assert_same_as_colocated, key_for
from tests.disagg.deployment_process import REPO, expected_kv_bytes, launched, metric

DEPLOYMENT = (REPO / "meshes" / "local-1p1d-mixed.toml").read_text().replace("timeout_s = 30", "timeout_s = 10") + '''
[[groups]]
name = "prefill-1"
role = "prefill"
mesh = "single"
devices_per_process = 1
'''


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with launched(tmp_path_factory.mktemp("mixed-2p1d"), "mixed-2p1d", DEPLOYMENT) as running:
        yield running


def group_stats(deployment, name: str) -> dict:
    return httpx.get(deployment.health["groups"][name]["control"] + "/stats", headers=deployment.control_auth,
                     timeout=5).json()


def test_different_meshes_equal_colocated(deployment, colocated_reference):
    groups = deployment.health["groups"]
    assert [(groups[g]["mesh"], groups[g]["devices"]) for g in ("prefill-0", "prefill-1", "decode-0")] == [
        ("tp=3", 3), ("single", 1), ("pp=2", 2)]
    # Everything through the tensor-parallel prefill group (counted from here: the module's
    # other tests may have run first).
    published = {g: group_stats(deployment, g)["transfers_published"] for g in ("prefill-0", "prefill-1")}
    moved = (metric(deployment.url, "jfire_kv_transfer_bytes_total"),
             group_stats(deployment, "decode-0")["kv_transfer_bytes"])
    lengths = assert_same_as_colocated(deployment.url, PROMPTS, colocated_reference,
                                       extra_headers={"x-session-affinity": key_for(0)})
    assert group_stats(deployment, "prefill-0")["transfers_published"] - published["prefill-0"] == len(PROMPTS)
    assert group_stats(deployment, "prefill-1")["transfers_published"] == published["prefill-1"]
    expected = expected_kv_bytes(lengths)
    assert metric(deployment.url, "jfire_kv_transfer_bytes_total") - moved[0] == expected
    assert group_stats(deployment, "decode-0")["kv_transfer_bytes"] - moved[1] == expected


def test_a_session_key_keeps_a_conversation_on_one_prefill_group(deployment):
    before = {g: group_stats(deployment, g) for g in ("prefill-0", "prefill-1")}
    messages = [{"role": "user", "content": "Name a colour of the sky, and explain why it looks that way."}]
    for turn in range(3):
        text, *_ = ask(deployment.url, {"messages": messages, "max_tokens": 8},
                       extra_headers={"x-session-affinity": key_for(1)})
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And question {turn}?"}]
    after = {g: group_stats(deployment, g) for g in ("prefill-0", "prefill-1")}
    assert after["prefill-1"]["transfers_published"] - before["prefill-1"]["transfers_published"] == 3
    assert after["prefill-0"]["transfers_published"] == before["prefill-0"]["transfers_published"]
    # Turns 2 and 3 found the earlier turns' pages in that group's prefix cache.
    assert after["prefill-1"]["prefix_hit_tokens"] - before["prefill-1"]["prefix_hit_tokens"] >= 2 * 16
