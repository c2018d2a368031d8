"""`--kv-cache-gb auto` (jfire/device_memory.py): serve and launch size their page pool with
`jfire plan`'s own function, for the memory stated with --device-memory-gib on these CPU
devices, and refuse to start, with the plan's figures, when one full context does not fit.

The plans the tests compare with are computed here, by `plan.plan` with the same arguments
(the workspace estimated, as serve's auto does and `jfire plan --no-compile` prints).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import jax
import pytest

from jfire import cli, device_memory, plan, plan_format
from jfire import mesh as meshes
from jfire.disagg import launch
from jfire.disagg.deployment import Deployment
from jfire.engine_config import EngineConfig
from jfire.errors import JfireError
from jfire.runner import pool_size
from tests.serve.server_process import start_server
from tests.tiny_models import COMMON, LLAMA4_TEXT

LIMITS = ["--max-batch", "4", "--prefill-budget", "64", "--max-context", "512"]
FITS_GIB = 1.7  # the default model in float32: ~0.5 GiB of weights, a 1 GiB reserve, ~0.18 GiB of pages
TOO_SMALL_GIB = 1.5  # less than the weights, workspace and reserve


def plan_of(checkpoint, gib: float, *, spec=None, dtype="float32") -> dict:
    return plan.plan(
        str(checkpoint),
        spec or meshes.resolve(None),
        dtype=dtype,
        limits=plan.Limits(max_batch=4, prefill_budget=64, max_context=512),
        compile=False,
        device_memory_gib=gib,
    )


def test_serve_auto_takes_the_plans_pages(default_checkpoint, tmp_path):
    expected = plan_of(default_checkpoint, FITS_GIB)
    assert expected["fits"] and expected["kv_pages"] > 512 // 16
    args = ["--kv-cache-gb", "auto", "--device-memory-gib", str(FITS_GIB), *LIMITS, "--quick-compile"]
    server = start_server(args, tmp_path / "server.log")
    try:
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    pages = float(re.search(r"^jfire_kv_pages_total (\S+)$", metrics, re.M).group(1))
    assert pages == expected["kv_pages"]
    # It says so at start-up, with the figures.
    assert f"jfire: --kv-cache-gb auto: {plan.format_pool(expected)}" in server.log.read_text()


def test_serve_auto_refuses_with_the_figures_when_a_context_does_not_fit(default_checkpoint):
    expected = plan_of(default_checkpoint, TOO_SMALL_GIB)
    assert not expected["fits"]
    cmd = [sys.executable, "-m", "jfire.cli", "serve", "--port", "0", "--kv-cache-gb", "auto",
           "--device-memory-gib", str(TOO_SMALL_GIB), *LIMITS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"jfire: error: --kv-cache-gb auto: {plan.format_refusal(expected)}"], proc.stderr
    d = expected["per_device"][0]
    for figure in ("device memory 1.50 GiB (from --device-memory-gib)", f"weights {plan_format._gib(d['weight_bytes'])}",
                   "reserve 1.00 GiB", "one 512-token context needs", "Lower --max-context"):
        assert figure in lines[0], figure


def test_launch_gives_each_group_the_plans_pages(default_checkpoint, monkeypatch):
    """A launch hands --kv-cache-gb auto and --device-memory-gib to its group processes, and
    each sizes its pool as `jfire.disagg.worker.run` does, for its own mesh and devices."""
    seen = {}

    def launch_local(deployment, deployment_arg, options, secret):  # records what each process would be given
        seen["options"] = options
        return 0

    monkeypatch.setattr(launch, "launch_local", launch_local)
    asked = ["launch", "local-1p1d", "--model", str(default_checkpoint), "--kv-cache-gb", "auto",
             "--device-memory-gib", str(FITS_GIB), *LIMITS]
    assert cli.main(asked) == 0
    parser = cli.build_parser()
    group_args = parser.parse_args(launch.process_argv("local-1p1d", 1, "127.0.0.1:9", seen["options"]))
    size = device_memory.PoolSize.of(group_args)
    assert size == device_memory.PoolSize(device_memory.AUTO, FITS_GIB)
    deployment = Deployment.load("local-1p1d")
    for group in deployment.groups:
        config = device_memory.size_pool(cli.engine_config(group_args, single=False), size,
                                         model=group_args.model, dtype=group_args.dtype, spec=group.mesh,
                                         devices=jax.local_devices())
        expected = plan_of(default_checkpoint, FITS_GIB, spec=group.mesh)
        assert config.num_pages is None and config.kv_cache_bytes == expected["kv_cache_bytes_per_device"]


def test_auto_on_cpu_devices_needs_their_memory_stated(default_checkpoint):
    config = cli.engine_config(cli.build_parser().parse_args(["serve", *LIMITS]), single=False)
    devices = jax.devices()
    single = meshes.resolve(None)
    with pytest.raises(JfireError, match=r"--kv-cache-gb auto needs --device-memory-gib G on cpu devices"):
        device_memory.size_pool(config, device_memory.PoolSize(device_memory.AUTO), model=str(default_checkpoint),
                                dtype="float32", spec=single, devices=devices)
    # Left out on CPU devices: 1 GiB, as before; --device-memory-gib alone means auto.
    left_out = device_memory.size_pool(config, device_memory.PoolSize(), model=str(default_checkpoint),
                                       dtype="float32", spec=single, devices=devices)
    assert left_out == config and config.kv_cache_bytes == 1 << 30 and config.num_pages is None
    stated = device_memory.size_pool(config, device_memory.PoolSize(None, FITS_GIB), model=str(default_checkpoint),
                                     dtype="float32", spec=single, devices=devices)
    assert stated.num_pages is None
    assert stated.kv_cache_bytes == plan_of(default_checkpoint, FITS_GIB)["kv_cache_bytes_per_device"]
    with pytest.raises(JfireError, match="--device-memory-gib goes with --kv-cache-gb auto"):
        device_memory.PoolSize(2.0, FITS_GIB)


def tiny_llama4(tmp_path, **text) -> str:
    """A tiny Llama 4's config.json alone: NoPE every fourth layer (global attention), chunks of 8
    on the others: two cache groups."""
    hf = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", **COMMON, **LLAMA4_TEXT,
          "num_hidden_layers": 8, "no_rope_layers": [1, 1, 1, 0] * 2, "max_position_embeddings": 4096, **text}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


@pytest.mark.parametrize("max_batch", [4, 64])
def test_auto_gives_the_engine_the_plans_pools_of_each_kind(tmp_path, max_batch):
    """Auto hands the engine the bytes of the plan's pools, from which `runner.pool_size` sizes
    exactly the plan's pools: each chunked row's window and the rest to the global layers (4
    rows), or one pool where the rows' windows would leave the global layers less (64 rows of
    256-token steps in about 40 MiB of room); an engine keeping one pool (moving pages by id)
    gets `kv_pages_one_pool` pages in every group from the same bytes."""
    model = tiny_llama4(tmp_path)
    gib = 1.05 if max_batch == 64 else 1.2
    limits = plan.Limits(max_batch=max_batch, prefill_budget=256, max_context=4096)
    p = plan.plan(model, meshes.resolve(None), dtype="float32", limits=limits, compile=False, device_memory_gib=gib)
    assert p["fits"] and [g["attends"] for g in p["kv_groups"].values()] == ["all", "chunk"]
    assert p["kv_pools_shared"] == (max_batch == 64)
    config = EngineConfig(max_batch=max_batch, prefill_budget=256, max_model_len=4096)
    config = device_memory.size_pool(config, device_memory.PoolSize(None, gib), model=model, dtype="float32",
                                     spec=meshes.resolve(None), devices=jax.devices())
    cfg = plan.read_model_config(model)
    counts, shared = pool_size(cfg, jax.numpy.float32, None, config, 4096)
    assert counts == {name: g["pages"] for name, g in p["kv_groups"].items()} and shared == p["kv_pools_shared"]
    one_pool, _ = pool_size(cfg, jax.numpy.float32, None, config, 4096, shared=True)
    assert one_pool == {"global": p["kv_pages_one_pool"], "chunked": p["kv_pages_one_pool"]}
    per_page = {name: g["page_bytes_per_device"] for name, g in p["kv_groups"].items()}
    assert sum(n * per_page[name] for name, n in one_pool.items()) <= config.kv_cache_bytes
    if not shared:  # the chunked layers' pool: each row's window, 8 - 1 + 256 positions over at most 18 pages
        assert counts["chunked"] == max_batch * 18 and counts["global"] > p["kv_pages_one_pool"]
        assert p["kv_capacity_tokens"] == 16 * counts["global"]


@pytest.mark.parametrize("text,ok", [("auto", "auto"), ("0.5", 0.5), ("0", None), ("lots", None)])
def test_kv_cache_gb_takes_a_number_or_auto(text, ok):
    args = ["serve", "--kv-cache-gb", text]
    if ok is None:
        with pytest.raises(JfireError, match="--kv-cache-gb"):
            cli.build_parser().parse_args(args)
    else:
        assert cli.build_parser().parse_args(args).kv_cache_gb == ok


def test_jax_allocator_set_only_where_the_user_left_it():
    assert device_memory.allocator_env({}) == device_memory.PLAN_ALLOCATOR
    assert device_memory.PLAN_ALLOCATOR == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_CLIENT_MEM_FRACTION": "0.99"}
    for name in device_memory.USER_ALLOCATOR_VARS:
        assert device_memory.allocator_env({name: "0.5"}) == {}
    assert device_memory.allocator_env({"JAX_PLATFORMS": "cpu"}) == {}  # nothing changes on CPU
    assert device_memory.allocator_env({"JAX_PLATFORMS": "cuda,cpu"}) == device_memory.PLAN_ALLOCATOR
