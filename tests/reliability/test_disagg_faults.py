"""Processes of a real `jfire launch` deployment killed at chosen and at random points: before
a prefill publishes, between publishing and the pull (mid-transfer), mid-stream on the decode
side, and anywhere under load. Every request ends (completed and correct, or failed with a
clear error), no surviving group keeps a page, the launcher restarts the dead process, the
frontend routes to it again, and between rounds correct requests return exactly colocated
`jfire generate`'s greedy output.

The deployment: the frontend, prefill-0 and prefill-1 (so a dead prefill group is routed
around) and decode-0, one CPU device each; the prefill groups have host tiers, through which
they share prefix blocks (jfire.disagg.prefix_store), and one is killed mid-fetch."""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time

import httpx
import openai
import pytest

from jfire import soak
from tests import limits
from tests.disagg.clients import PROMPTS, ask, assert_same_as_colocated, client, key_for
from tests.disagg.deployment_process import REPO, launch, metric, wait_for
from tests.reliability.tally import TALLY

TRANSFER_TIMEOUT_S = 5
DEPLOYMENT = (REPO / "meshes" / "local-1p1d.toml").read_text().replace(
    "timeout_s = 30", f"timeout_s = {TRANSFER_TIMEOUT_S}") + '''
[[groups]]
name = "prefill-1"
role = "prefill"
mesh = "single"
devices_per_process = 1
'''
GROUPS = ("prefill-0", "prefill-1", "decode-0")
# A restarted group loads the model and compiles (from the run's compilation cache) again:
# seconds alone, up to a few minutes with three other JAX processes on two loaded cores.
RESTART_BOUND_S = 300
# The slowest a request may take to end after a fault before it counts as a hang: the
# transfer deadline plus time for the loaded machine.
END_BOUND_S = TRANSFER_TIMEOUT_S + 25
CONTROL_AUTH: dict = {}  # the deployment's control token, for the groups' control routes (set by the fixture)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults-2p1d")
    path = tmp / "faults-2p1d.toml"
    path.write_text(DEPLOYMENT)
    running = launch(path, tmp / "launch.log", extra=("--max-restarts", "10", "--host-kv-gb", "0.05"))
    CONTROL_AUTH.update(running.control_auth)
    yield running
    code = running.stop()
    assert code == 0, running.log.read_text()[-3000:]


def health(deployment) -> dict:
    """/health as the deployment's control token sees it: with its groups' addresses and pids."""
    return httpx.get(deployment.url + "/health", headers=deployment.control_auth, timeout=10).json()


def all_up(deployment) -> dict:
    """Every group alive (after an earlier test's restart, too); returns /health."""
    return wait_for(lambda: (h := health(deployment))["status"] == "ok" and h, RESTART_BOUND_S, "every group up")


def stats(group: dict) -> dict:
    return httpx.get(group["control"] + "/stats", headers=CONTROL_AUTH, timeout=10).json()


def kill(group: dict, sig=signal.SIGKILL) -> None:
    os.kill(group["pid"], sig)
    TALLY.faults += sig != signal.SIGCONT


def restarted(deployment, name: str, before: dict) -> dict:
    """Waits for `jfire launch` to restart the group and the frontend to route to it again."""
    h = wait_for(lambda: (h := health(deployment))["status"] == "ok"
                 and h["groups"][name]["restarts"] == before["groups"][name]["restarts"] + 1 and h,
                 RESTART_BOUND_S, f"{name} to be restarted")
    assert h["groups"][name]["pid"] != before["groups"][name]["pid"]
    TALLY.restarts += 1
    return h


def assert_correct_and_nothing_held(deployment, colocated_reference) -> None:
    """Correct requests return colocated generation's greedy output, and once they are done
    no group holds a page, a pending transfer or a pull thread (prefill groups release a
    transfer nobody pulled at its deadline)."""
    TALLY.sent += 2
    assert_same_as_colocated(deployment.url, PROMPTS[:2], colocated_reference[:2])
    TALLY.completed += 2
    groups = all_up(deployment)["groups"]

    def idle():
        now = {name: stats(groups[name]) for name in GROUPS}
        return all(s["pages_used"] == 0 and s.get("transfers_pending", 0) == 0 and s.get("pull_threads", 0) == 0
                   for s in now.values()) and now

    try:
        wait_for(idle, TRANSFER_TIMEOUT_S + 30, "every group to hold nothing")
    except AssertionError:
        TALLY.leaked_pages += sum(stats(groups[name])["pages_used"] for name in GROUPS)
        raise


SOAK_S = 60  # the short soak's load; the long one (12 minutes) is scripts/soak.py, a benchmark


def test_a_short_soak_of_mixed_traffic_with_no_fault_loses_nothing(deployment):
    """Before any fault: a minute of mixed agent traffic (jfire.soak: 4-8 clients, streams,
    schemas, tool calls, n=2, logprobs, repeated and context-filling prompts, clients leaving
    mid-stream, malformed requests) gets no 5xx, no stream error event and no failed transfer;
    the greedy probe never changes; once idle every group holds no page, no pending transfer and
    no running pull, and no process keeps a thread per request or transfer."""
    all_up(deployment)
    pool_tokens = stats(health(deployment)["groups"]["decode-0"])["pages_total"] * 16
    config = soak.SoakConfig(duration_s=SOAK_S, context=min(limits.CONTEXT, pool_tokens), clients_period_s=10,
                             sample_s=10, probe_s=5, warmup_s=0, seed=41, request_timeout_s=120,
                             idle_timeout_s=TRANSFER_TIMEOUT_S + 30)
    result = soak.run(soak.Deployment(deployment.url, launcher_pid=deployment.process.pid,
                                      control_headers=deployment.control_auth), config, log=lambda line: None)
    by_outcome = collections.Counter()
    for outcomes in result["by_kind"].values():
        by_outcome.update(outcomes)
    TALLY.add({"sent": result["requests"] + result["probes"], "completed": by_outcome["ok"] + result["probes"],
               "faults": by_outcome["left"] + by_outcome["refused"], "failed_cleanly": by_outcome["refused"]})
    summary = {k: result[k] for k in ("5xx_by_cause", "stream_errors_by_cause", "client_errors_by_cause",
                                      "wrong_refusals_by_cause", "by_kind")}
    assert result["requests"] >= 10 and by_outcome["ok"] >= 5, summary  # it did load the deployment
    assert (result["5xx"], result["stream_errors"], result["client_errors"], result["wrong_refusals"]) == (0, 0, 0, 0), \
        summary
    before = result["before"]["counters"]
    failed = {name: (c.get("transfers_failed", 0) - before[name].get("transfers_failed", 0),
                     c.get("transfers_corrupted", 0) - before[name].get("transfers_corrupted", 0))
              for name, c in result["idle"].items()}
    errors = {name: c.get("last_transfer_error") for name, c in result["idle"].items() if c.get("last_transfer_error")}
    assert all(f == (0, 0) for f in failed.values()), (failed, errors)
    assert len(result["probe_outputs"]) == 1 and result["probes"] >= 3, result["probe_outputs"]
    for name, held in result["idle"].items():
        assert (held.get("pages_used", 0), held.get("transfers_pending", 0), held.get("pull_threads", 0)) == (0, 0, 0), \
            (name, held)
    # Threads: none per request or transfer. The frontend's HTTP service renders prompts, and
    # the groups' control servers submit requests (a grammar compiles there), on asyncio's
    # default executor, which starts up to min(32, cores + 4) threads as the load needs them
    # and keeps them; every other thread of every process is there from the start.
    executor = min(32, (os.cpu_count() or 1) + 4)
    for name, p in result["processes"].items():
        allowed = result["before"]["processes"][name]["threads"] + executor
        assert p["threads"][-1] <= allowed, (name, p["threads"])


def test_killing_decode_mid_stream_fails_clearly_and_it_comes_back(deployment, colocated_reference):
    before = all_up(deployment)
    stream = client(deployment.url).completions.create(
        model="default", prompt="Count from one to one hundred:", max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    TALLY.sent += 1
    after_events = random.Random(15).randint(1, 8)
    for received, _ in enumerate(stream, start=1):
        if received == after_events:
            break
    kill(before["groups"]["decode-0"])
    t0 = time.time()
    with pytest.raises(openai.APIError) as failure:
        for _ in stream:
            pass
    assert time.time() - t0 < 10  # noticed at once (the stream breaks), not after a request timeout
    assert "decode group 'decode-0' stopped answering mid-stream" in str(failure.value)
    TALLY.failed_cleanly += 1
    # Until the launcher has it back, the frontend says why nothing can be decoded.
    h = health(deployment)
    assert h["status"] == "degraded" and h["groups"]["decode-0"]["alive"] is False
    r = httpx.post(deployment.url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                   timeout=30)
    TALLY.sent += 1
    assert r.status_code == 500 and "no decode group is up" in r.json()["error"]["message"]
    TALLY.failed_cleanly += 1
    restarted(deployment, "decode-0", before)
    assert_correct_and_nothing_held(deployment, colocated_reference)


def test_killing_a_prefill_group_before_it_publishes(deployment, colocated_reference):
    before = all_up(deployment)
    victim = before["groups"]["prefill-0"]
    # Frozen first, so the request is certainly waiting on a prefill that never publishes.
    kill(victim, signal.SIGSTOP)
    result: dict = {}

    def request():
        try:
            ask(deployment.url, {"prompt": "Tell me about the ocean.", "max_tokens": 8},
                extra_headers={"x-session-affinity": key_for(0)})
        except openai.APIError as e:
            result["error"] = e
        result["at"] = time.time()

    thread = threading.Thread(target=request)
    thread.start()
    TALLY.sent += 1
    time.sleep(1.0)
    assert thread.is_alive()
    killed_at = time.time()
    kill(victim)
    thread.join(timeout=END_BOUND_S)
    assert not thread.is_alive(), "the request hung after its prefill group died"
    assert result["at"] - killed_at < 10
    assert "prefill group 'prefill-0' failed before publishing" in str(result["error"])
    TALLY.failed_cleanly += 1
    h = health(deployment)
    assert h["status"] == "degraded" and h["groups"]["prefill-0"]["alive"] is False
    # The same session key now goes to the group still up, and is served correctly.
    TALLY.sent += 1
    assert_same_as_colocated(deployment.url, PROMPTS[:1], colocated_reference[:1],
                             extra_headers={"x-session-affinity": key_for(0)})
    TALLY.completed += 1
    assert stats(h["groups"]["prefill-1"])["transfers_published"] >= 1
    restarted(deployment, "prefill-0", before)
    assert_correct_and_nothing_held(deployment, colocated_reference)


def test_killing_prefill_mid_transfer(deployment, colocated_reference):
    """Published but not yet pulled: the decode group is frozen while the prefill publishes,
    the prefill process is killed, and the decode group, thawed, finds its sender gone."""
    before = all_up(deployment)
    prefill, decode = before["groups"]["prefill-0"], before["groups"]["decode-0"]
    handoffs = metric(deployment.url, "jfire_kv_handoffs_total")
    kill(decode, signal.SIGSTOP)
    result: dict = {}

    def request():
        try:
            result["text"] = ask(deployment.url, {"prompt": "Tell me about the mountains.", "max_tokens": 8},
                                 extra_headers={"x-session-affinity": key_for(0)})
        except openai.APIError as e:
            result["error"] = e

    thread = threading.Thread(target=request)
    try:
        thread.start()
        TALLY.sent += 1
        # Kept short: a process frozen past the cluster's 10 s heartbeat would be declared dead.
        # The frontend has the prefill group's answer (published, not yet pulled): killing the
        # prefill group any earlier would test the failure before publishing instead.
        wait_for(lambda: metric(deployment.url, "jfire_kv_handoffs_total") > handoffs, 8,
                 "the frontend to receive the prefill group's published transfer")
        kill(prefill)
    finally:
        kill(decode, signal.SIGCONT)
    thread.join(timeout=END_BOUND_S)
    assert not thread.is_alive(), "the request hung after its KV cache's sender died"
    assert "text" not in result, "a request whose KV cache was never pulled cannot have completed"
    # Either the probe finds nothing listening or the pull's connection breaks: both end it.
    assert "pulling the KV cache from prefill group 'prefill-0' failed" in str(result["error"])
    TALLY.failed_cleanly += 1
    assert stats(decode)["pages_used"] == 0  # freed before the error was sent; the thread is waited for below
    restarted(deployment, "prefill-0", before)
    assert_correct_and_nothing_held(deployment, colocated_reference)


def prefill_directly(group: dict, request_id: str, prompt_ids: list[int], prefix_from: dict | None = None) -> dict:
    """A prompt sent to a prefill group as the frontend sends it (its KV is never pulled: the
    group releases it at the transfer's deadline)."""
    from jfire.sampling import SamplingParams

    body = {"request_id": request_id, "prompt_ids": prompt_ids, "shards": 1, "prefix_from": prefix_from,
            "sampling": SamplingParams(temperature=0.0, max_tokens=1, seed=0).to_json()}
    r = httpx.post(group["control"] + "/prefill", json=body, headers=CONTROL_AUTH, timeout=END_BOUND_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefix_fetched_from_another_group_and_its_holder_killed_mid_fetch(deployment, colocated_reference):
    """The shared prefix store between the two prefill groups: a prompt prefill-0 computed is
    taken by prefill-1 (its first token the same as computing it); with prefill-0 frozen and
    then killed while prefill-1 fetches from it, prefill-1 computes the prompt itself, equally,
    within the fetch's limit, and nothing is held afterwards."""
    from jfire.checkpoint.load import load_config_and_tokenizer
    from jfire.disagg.prefix_store import FETCH_TIMEOUT_S

    before = all_up(deployment)
    holder, taker = before["groups"]["prefill-0"], before["groups"]["prefill-1"]
    # A prompt no other test sends, so neither group holds any of it yet.
    ids = load_config_and_tokenizer("default")[1].encode("A prefix to share. " + PROMPTS[4]["prompt"])
    blocks = len(ids) // 16
    computed = prefill_directly(holder, "shared-0", ids)
    source = {"group": "prefill-0", "first": 0, "blocks": blocks}
    received = stats(taker)["shared_blocks_received"]
    taken = prefill_directly(taker, "shared-1", ids, source)
    assert taken["first_token"] == computed["first_token"]
    assert stats(taker)["shared_blocks_received"] == received + blocks
    assert taken["prefix_hit_tokens"] == min(blocks * 16, len(ids) - 1) // 16 * 16  # all its blocks fetched
    received += blocks

    kill(holder, signal.SIGSTOP)  # frozen well inside the cluster's 10 s heartbeat
    result: dict = {}

    def fetch_while_the_holder_dies():
        t0 = time.time()
        result["answer"] = prefill_directly(taker, "shared-2", ids, source)
        result["s"] = time.time() - t0

    thread = threading.Thread(target=fetch_while_the_holder_dies)
    thread.start()
    TALLY.sent += 1
    time.sleep(1.5)
    kill(holder)
    thread.join(timeout=FETCH_TIMEOUT_S + END_BOUND_S)
    assert not thread.is_alive(), "a prefill hung on a dead holder"
    assert result["answer"]["first_token"] == computed["first_token"]
    assert result["s"] < FETCH_TIMEOUT_S + 10
    assert stats(taker)["shared_blocks_received"] == received  # nothing arrived from the dead holder
    TALLY.completed += 1
    restarted(deployment, "prefill-0", before)
    assert_correct_and_nothing_held(deployment, colocated_reference)


def test_clients_that_leave_through_the_frontend_are_cancelled(deployment, colocated_reference):
    """Streaming clients that close after a random number of events and non-streaming ones
    that give up after a random wait: each request is cancelled through the frontend and
    the decode group, so far fewer tokens are generated than were asked for, and nothing is
    held afterwards."""
    rng = random.Random(11)
    groups = all_up(deployment)["groups"]
    generated_before = stats(groups["decode-0"])["tokens_generated"]
    asked = 0
    for i in range(4):
        body = {"model": "default", "prompt": f"Count from {i} to one thousand:", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
        asked += body["max_tokens"]
        TALLY.sent += 1
        TALLY.faults += 1
        if body["stream"]:
            leave_after = rng.randint(1, 20)
            with httpx.stream("POST", deployment.url + "/v1/completions", json=body, timeout=60) as r:
                for events, _ in enumerate(r.iter_lines(), start=1):
                    if events >= leave_after:
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                httpx.post(deployment.url + "/v1/completions", json=body, timeout=rng.uniform(0.5, 1.5))
        TALLY.failed_cleanly += 1
    assert_correct_and_nothing_held(deployment, colocated_reference)
    # Run to the end, the four would have generated `asked` tokens (and the check above 2 x 16).
    generated = stats(groups["decode-0"])["tokens_generated"] - generated_before
    assert generated < asked / 2, (generated, asked)


@pytest.mark.parametrize("seed", [7, 8])
def test_a_random_process_killed_at_a_random_point_under_load(deployment, colocated_reference, seed):
    rng = random.Random(seed)
    before = all_up(deployment)
    victim = rng.choice(GROUPS)
    prompts = [(i, rng.choice(range(len(PROMPTS))), rng.random() < 0.5) for i in range(6)]
    results: dict = {}

    def request(i: int, which: int, stream: bool):
        prompt = PROMPTS[which]
        try:
            if stream:
                body = {"model": "default", "max_tokens": prompt["max_tokens"], "temperature": 0,
                        "stop": prompt.get("stop")}
                key = "messages" if "messages" in prompt else "prompt"
                create = (client(deployment.url).chat.completions.create if key == "messages"
                          else client(deployment.url).completions.create)
                chunks = list(create(**body, **{key: prompt[key]}, stream=True))
                results[i] = ("done", chunks)
            else:
                results[i] = ("done", ask(deployment.url, prompt))
        except openai.APIError as e:
            results[i] = ("error", e)

    threads = [threading.Thread(target=request, args=p) for p in prompts]
    for t in threads:
        t.start()
    TALLY.sent += len(threads)
    time.sleep(rng.uniform(0.0, 1.5))
    kill(before["groups"][victim])
    for t in threads:
        t.join(timeout=END_BOUND_S)
    hung = sum(t.is_alive() for t in threads)
    TALLY.hangs += hung
    assert not hung, f"{hung} requests hung after {victim} was killed"
    for i, which, stream in prompts:
        kind, value = results[i]
        if kind == "error":  # the server's own clear message, never a dropped connection
            assert not isinstance(value, openai.APIConnectionError) and "group" in str(value), value
            TALLY.failed_cleanly += 1
        elif not stream:  # completed: exactly colocated generation
            ref = colocated_reference[which]
            assert value == (ref["text"], len(ref["prompt_ids"]), len(ref["token_ids"]), ref["finish_reason"])
            TALLY.completed += 1
        else:
            text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                           for c in value if c.choices)
            assert text == colocated_reference[which]["text"]
            TALLY.completed += 1
    restarted(deployment, victim, before)
    assert_correct_and_nothing_held(deployment, colocated_reference)
