"""Shared fixtures: tiny random HF models saved to disk by the tests themselves, and the
default model (converted once into checkpoints/, as users get it)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.reliability.tally import TALLY
from tests.tiny_models import save_tiny_hf_model
from tests.xdist_recovery import RecoveringLoadScopeScheduling, rerun_status, retry_crash

# Tests run on the CPU; keep XLA from grabbing every core for one tiny matmul.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for this run's processes (the jfire commands the tests start
# read it), fresh each run: the suite's time never depends on what an earlier run compiled.
_OWN_CACHE = None
if "JFIRE_COMPILE_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["JFIRE_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jfire-test-xla-")


def pytest_configure(config):
    """The tests' own engines and programs use that cache too: a program another module or the
    other worker already compiled (the same model at the same shapes) is loaded, not rebuilt."""
    from jfire.engine import enable_compilation_cache

    enable_compilation_cache(os.environ["JFIRE_COMPILE_CACHE"])


# The suite runs on two parallel workers (pytest -n 2 --dist loadscope --no-loadscope-reorder in
# pyproject.toml), each module on one worker, handed out in collection order as workers free up
# (xdist's own reordering, by number of tests, would put 40 quick sampling tests before a
# 2-minute module). The slowest modules go first, longest first (summed from
# `pytest --durations=0` on a fresh clone), so that no worker is left running a long one alone
# at the end; the rest keep their order.
SLOWEST_FIRST = [
    "tests/test_lockstep_groups.py",
    "tests/serve/test_agent_api.py",
    "tests/test_engine_moe.py",
    "tests/test_mesh_suite.py",
    "tests/reliability/test_disagg_faults.py",
    "tests/disagg/test_disagg_1p1d.py",
    "tests/disagg/test_disagg_images.py",
    "tests/serve/test_images_api.py",
    "tests/reliability/test_serve_faults.py",
    "tests/models/test_hf_parity.py",
    "tests/test_speculative.py",
    "tests/disagg/test_disagg_meshes.py",
    "tests/disagg/test_disagg_groups.py",
    "tests/test_default_model.py",
    "tests/serve/test_openai_api.py",
    "tests/serve/test_tool_constraints.py",
    "tests/serve/test_speculative_streaming.py",
    "tests/disagg/test_disagg_moe.py",
    "tests/test_engine.py",
    "tests/test_pools_per_kind.py",
    "tests/models/test_llama4_cache_groups.py",
    "tests/reliability/test_host_tier_faults.py",
    "tests/disagg/test_prefix_store.py",
    "tests/test_cli.py",
    "tests/test_plan.py",
    "tests/test_batch_mode.py",
    "tests/test_compression_scripts.py",
    "tests/kernels/test_paged_attention.py",
    "tests/kernels/test_palette_matmul.py",
    "tests/kernels/test_cpu_kernel_builds.py",
    "tests/test_cache.py",
    "tests/test_compile_cache.py",
    "tests/test_cli_mesh.py",
    "tests/disagg/test_deployment.py",
    "tests/checkpoint/test_compressed_default_model.py",
    "tests/checkpoint/test_compressed_checkpoint.py",
    "tests/kernels/test_bf16_decode.py",
    "tests/test_bench_compare.py",
    "tests/serve/test_limits_and_fuzz.py",
    "tests/test_engine_preemption.py",
    "tests/test_speculative_eagle3.py",
    "tests/test_speculative_mtp.py",
    "tests/vision/test_image_engine.py",
    "tests/test_lockstep_beats.py",
    "tests/serve/test_shutdown.py",
    "tests/kernels/test_mla_attention.py",
    "tests/kernels/test_prefill_attention.py",
    "tests/kernels/test_grouped_matmul.py",
]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    rank = {module: i for i, module in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:  # a parallel worker: its fault-suite counts go to the controller
        worker_output["fault_tally"] = dataclasses.asdict(TALLY)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Loadscope scheduling that finishes the run after a worker crashes (tests/xdist_recovery.py)."""
    if config.getvalue("dist") == "loadscope":
        return RecoveringLoadScopeScheduling(config, log)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """The test a worker died in runs once more on a new worker (tests/xdist_recovery.py)."""
    retry_crash(crashitem, report, sched)


def pytest_report_teststatus(report, config):
    return rerun_status(report)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    TALLY.add(getattr(node, "workeroutput", {}).get("fault_tally", {}))


def pytest_terminal_summary(terminalreporter):
    if TALLY.sent:  # the fault suite ran (tests/reliability)
        terminalreporter.write_line(TALLY.line())


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """Returns a function family -> path of a saved tiny random HF model (cached per session)."""
    made = {}

    def make(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(family)
            save_tiny_hf_model(family, path, **kwargs)
            made[key] = path
        return made[key]

    return make


def run_directory(tmp_path_factory) -> Path:
    """A directory this run's processes share (the parallel workers' temporary directories
    sit side by side in it) and no other run sees."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def colocated_reference(tmp_path_factory):
    """The shared test prompts (tests/disagg/clients.py) through colocated `jfire generate`:
    the greedy reference the server, deployment and fault tests compare with. Generated once
    per run: the first worker to need it writes it down, the other reads it."""
    from filelock import FileLock

    from tests.disagg.clients import PROMPTS
    from tests.disagg.deployment_process import colocated

    path = run_directory(tmp_path_factory) / "colocated-reference.json"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            path.write_text(json.dumps(colocated(PROMPTS, tmp_path_factory.mktemp("colocated"))))
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def default_hf_reference(tmp_path_factory):
    """(tokenizer, model): transformers loading the default model's GGUF in float32, the
    independent reference for its tokens, logits and logprobs. transformers' GGUF loader takes
    ~20 s (most of it parsing the file's metadata in Python), so the first worker to need it
    writes what it loaded down (the same float32 tensors, config and tokenizer) and the other
    reads that back in ~3 s."""
    import safetensors.torch
    import torch
    import transformers
    from filelock import FileLock

    from jfire.checkpoint.default_model import GGUF_NAME, default_gguf_path

    saved = run_directory(tmp_path_factory) / "default-hf-reference"
    with FileLock(f"{saved}.lock"):
        if not (saved / "model.safetensors").exists():
            path = default_gguf_path()
            tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=GGUF_NAME)
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=GGUF_NAME,
                                                                      dtype=torch.float32)
            saved.mkdir(exist_ok=True)  # (a run stopped half-way through writing it)
            tok.save_pretrained(saved)
            model.config.to_json_file(saved / "config.json")
            safetensors.torch.save_model(model, str(saved / "model.safetensors"))  # last: the mark of a whole copy
            return tok, model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(saved)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(saved),
                                                          dtype=torch.float32)
    safetensors.torch.load_model(model, str(saved / "model.safetensors"))  # strict: every tensor, no extra
    return tok, model.eval()


@pytest.fixture(scope="session")
def default_checkpoint():
    from jfire.checkpoint.default_model import ensure_default_checkpoint

    return ensure_default_checkpoint()


# tests/mesh needs 8 host devices, which must be requested before JAX starts: the main
# session runs them in a child process of their own (tests/test_mesh_suite.py).
collect_ignore = [] if os.environ.get("JFIRE_MESH_SESSION") == "1" else ["mesh"]
