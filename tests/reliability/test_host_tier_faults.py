"""Faults of the host-memory tier (jfire.host_tier) against one real `jfire serve --host-kv-gb`
of a tiny model, whose device pool (32 pages) and host tier (16 pages) are small enough that
a few dozen prompts overflow both:
- the host tier full under concurrent load: more distinct prefixes than the device and the
  host hold together; the tier drops its least recently used blocks and never fails a request;
- corrupt host entries (a fault hook flips a byte of chosen blocks as they reach host memory,
  after the device summed their bits): each is detected by its sum when loaded back, dropped
  and computed again, while the good blocks beside it are served from host memory.
Every answer equals the engine's own greedy tokens with no prefix cache at all (each prompt
computed from scratch, in this process), no request gets a 5xx, the tier's bytes stay within
its limit, and once the server is idle no device page is still used. (An entry of another
model is never matched: tests/test_host_tier.py.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from jfire.disagg.launch import free_port
from jfire.kv_cache import block_hashes, page_bytes
from tests.disagg.deployment_process import REPO
from tests.reliability.tally import TALLY
from tests.reliability.test_serve_faults import REQUEST_BOUND_S, health_status, metrics, wait_idle
from tests.serve.server_process import ServerProcess

PAGE, DEVICE_PAGES, HOST_PAGES = 16, 32, 16
MAX_TOKENS, PARALLEL, NAME = 8, 8, "tiny"
PREFIX, SUFFIX = 3 * PAGE, 4  # each prompt: 3 full blocks of its own, then a partial one


def prompt_set(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 256, size=PREFIX + SUFFIX)] for _ in range(n)]


DOCS = prompt_set(1, 20)  # the host tier full: 60 full blocks, against 32 + 16 pages
GOOD, VICTIM = prompt_set(2, 2)  # the corrupt entries: the victim's blocks are corrupted in host memory
FILLERS = prompt_set(3, 9)  # 36 pages: push both out of the device pool, not out of the host tier
CORRUPT = block_hashes(VICTIM, PAGE)

# `jfire serve` with a fault in host memory: every block of the victim's prompt that reaches the
# host tier has one byte of its first value flipped (the top byte of a float32: its exponent),
# after the device summed its bits. Served, such a block would change the tokens.
WRAPPER = f"""
import sys
from jfire import cli, faults

CORRUPT = {{bytes.fromhex(h) for h in {[h.hex() for h in CORRUPT]!r}}}

def flip_a_byte(block_hash, block):
    if block_hash in CORRUPT:
        first = block.arrays[0].copy()
        first.view("uint8").reshape(-1)[first.dtype.itemsize - 1] ^= 0x40
        block.arrays[0] = first

faults.host_block_saved = flip_a_byte
sys.exit(cli.main(["serve", *sys.argv[1:]]))
"""


def server_args(model_dir, page: int) -> list[str]:
    def gb(pages: int) -> str:  # exact: a page is a power of two bytes
        return repr(pages * page / (1 << 30))

    return ["--model", str(model_dir), "--served-model-name", NAME, "--kv-cache-gb", gb(DEVICE_PAGES),
            "--host-kv-gb", gb(HOST_PAGES), "--max-batch", "4", "--prefill-budget", "64", "--max-context", "128",
            "--quick-compile"]


def fault_free(model) -> dict[tuple, list[int]]:
    """Each prompt's greedy tokens from an engine with no prefix cache and no host tier."""
    from jfire.engine import Engine, EngineConfig
    from jfire.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    everything = DOCS + [GOOD, VICTIM] + FILLERS
    config = EngineConfig(num_pages=64, page_size=PAGE, max_batch=4, prefill_budget=64, max_model_len=128,
                          prefix_caching=False, aot=False, quick_compile=True)
    with Engine(model, config) as engine:
        results = engine.generate([(p, greedy) for p in everything])
    return {tuple(p): r.token_ids for p, r in zip(everything, results)}


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    from jfire.checkpoint.load import load_model

    path = tiny_hf_dir("llama2")
    return path, load_model(str(path), "float32")


@pytest.fixture(scope="module")
def page_nbytes(tiny) -> int:
    return page_bytes(tiny[1].config, PAGE, np.float32)


@pytest.fixture(scope="module")
def server(tiny, page_nbytes, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("host-tier-faults") / "server.log"
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", WRAPPER, "--port", str(port), *server_args(tiny[0], page_nbytes)],
                               cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        request.getfixturevalue("reference")  # computed here while the server compiles
        deadline = time.monotonic() + 600
        while health_status(url) != 200:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield ServerProcess(url, process, log, [200])
    finally:
        process.kill()  # its SIGTERM path is test_serve_faults.py's
        process.wait()


@pytest.fixture(scope="module")
def reference(tiny) -> dict[tuple, list[int]]:
    return fault_free(tiny[1])


async def complete(http: httpx.AsyncClient, prompt: list[int]) -> tuple[int, list[int] | None, int | None]:
    """(status, generated token ids, cached prompt tokens) of one greedy completion."""
    TALLY.sent += 1
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    try:
        r = await http.post("/v1/completions", json=body)
    except httpx.TimeoutException:
        TALLY.hangs += 1
        return 0, None, None
    if r.status_code != 200:
        return r.status_code, None, None
    out = r.json()
    return 200, out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def run(url: str, prompts: list[list[int]], reference: dict) -> list[int]:
    """Sends the prompts, PARALLEL at a time; asserts each answer is the fault-free one and
    returns each one's cached prompt tokens."""

    async def all_of_them():
        gate = asyncio.Semaphore(PARALLEL)
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_BOUND_S) as http:

            async def one(p):
                async with gate:
                    return await complete(http, p)

            return await asyncio.gather(*(one(p) for p in prompts))

    answers = asyncio.run(all_of_them())
    wrong = [(i, a) for i, (p, a) in enumerate(zip(prompts, answers)) if a[:2] != (200, reference[tuple(p)])]
    assert wrong == [], f"{len(wrong)} of {len(prompts)} answers are not the fault-free ones: {wrong}"
    TALLY.completed += len(prompts)
    return [cached for _, _, cached in answers]


def idle_and_within_limits(url: str, page_nbytes: int) -> dict[str, float]:
    m = wait_idle(url)
    TALLY.leaked_pages += int(m["jfire_kv_pages_used"])
    assert m["jfire_kv_pages_used"] == 0, f"{m['jfire_kv_pages_used']:g} device pages still used by an idle server"
    assert m["jfire_kv_pages_total"] == DEVICE_PAGES, m
    assert m["jfire_host_kv_bytes"] <= HOST_PAGES * page_nbytes and m["jfire_host_kv_blocks"] <= HOST_PAGES, m
    assert m["jfire_host_kv_bytes"] == m["jfire_host_kv_blocks"] * page_nbytes, m
    return m


def test_the_host_tier_full_under_concurrent_load(server, reference, page_nbytes):
    """Twenty prompts of three blocks each, eight at a time, then again in reverse order: 60
    distinct blocks against 32 device pages and 16 host pages. The tier saves far more than it
    holds (the least recently used go), loads some back, and every answer is the fault-free one."""
    before = metrics(server.url)
    cached = run(server.url, DOCS, reference) + run(server.url, DOCS[::-1], reference)
    m = idle_and_within_limits(server.url, page_nbytes)
    saved = m["jfire_host_kv_blocks_saved_total"] - before["jfire_host_kv_blocks_saved_total"]
    loaded = m["jfire_host_kv_blocks_loaded_total"] - before["jfire_host_kv_blocks_loaded_total"]
    figures = (f"host tier full: {saved:g} blocks saved into {HOST_PAGES} pages ({m['jfire_host_kv_blocks']:g} held, "
               f"{saved - m['jfire_host_kv_blocks']:g} dropped), {loaded:g} loaded back, "
               f"{sum(cached) // PAGE} blocks served from cache")
    print(figures)
    assert m["jfire_host_kv_blocks"] == HOST_PAGES and saved >= 2 * HOST_PAGES, figures  # full, and then some
    assert loaded >= 1 and sum(cached) >= loaded * PAGE, figures
    assert m["jfire_host_kv_blocks_corrupt_total"] == before["jfire_host_kv_blocks_corrupt_total"], figures


def test_corrupt_host_entries_are_computed_again_never_served(server, reference, page_nbytes):
    """Two prompts, then nine others that push both out of the device pool into host memory,
    where the victim's three blocks are corrupted. Asked again, the good prompt's blocks come
    back from host memory; the victim's are caught by their sums, dropped and computed again."""
    TALLY.faults += len(CORRUPT)
    before = metrics(server.url)
    assert run(server.url, [GOOD], reference) + run(server.url, [VICTIM], reference) == [0, 0]
    run(server.url, FILLERS, reference)
    wait_idle(server.url)  # the victim's blocks are saved (corrupted) by the time the fillers end
    good, victim = run(server.url, [GOOD], reference) + run(server.url, [VICTIM], reference)
    m = idle_and_within_limits(server.url, page_nbytes)
    corrupt = m["jfire_host_kv_blocks_corrupt_total"] - before["jfire_host_kv_blocks_corrupt_total"]
    loaded = m["jfire_host_kv_blocks_loaded_total"] - before["jfire_host_kv_blocks_loaded_total"]
    figures = (f"corrupt entries: {corrupt:g} blocks caught and computed again, {loaded:g} good blocks loaded back; "
               f"cached tokens {good} (good), {victim} (victim)")
    print(figures)
    assert (good, victim) == (PREFIX, 0), figures
    assert corrupt == len(CORRUPT) and loaded == len(block_hashes(GOOD, PAGE)), figures
