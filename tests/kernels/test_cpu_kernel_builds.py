"""How jfire's CPU kernel library is built, and what jfire does without it: every build the
kernel tests run (conftest.py: GCC for this CPU, GCC for AVX2 only, clang) compiles without a
warning at -Wall -Wextra; the compiler is found or named, or said to be missing; and on a
machine with no compiler one warning names both kernels and the model gives XLA's answers."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import pytest

from jfire.kernels import cpu_attention, cpu_matmul


def test_each_build_compiles_without_a_warning(kernel_library):
    name, path = kernel_library
    assert "-w" not in cpu_matmul.FLAGS and {"-Wall", "-Wextra"} <= set(cpu_matmul.FLAGS)
    assert cpu_matmul.diagnostics(path) == "", f"the {name} build warned:\n{cpu_matmul.diagnostics(path)}"


def test_the_compiler_is_found_named_or_said_to_be_missing(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found: none of g\+\+, clang\+\+, c\+\+ is on PATH"):
        cpu_matmul.find_compiler(search_path=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"the C\+\+ compiler '/nonexistent/g\+\+' was not found"):
        cpu_matmul.find_compiler("/nonexistent/g++")
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(RuntimeError, match=r"'/nonexistent/g\+\+' \(\$CXX\) was not found"):
        cpu_matmul.find_compiler(search_path=str(tmp_path))
    monkeypatch.delenv("CXX")
    clang = tmp_path / "clang++"  # without g++, clang
    clang.write_text("#!/bin/sh\n")
    clang.chmod(0o755)
    assert cpu_matmul.find_compiler(search_path=str(tmp_path)) == str(clang)


@pytest.fixture
def fresh_traces():
    """Whether the kernels are available is read when a program is traced: no trace made with
    them may be reused without them, nor the other way round; afterwards `available()` asks
    again (with the environment monkeypatch restores)."""
    jax.clear_caches()
    cpu_matmul.available.cache_clear()
    yield
    cpu_matmul.available.cache_clear()
    jax.clear_caches()


def lowered_prefill_and_decode(cfg, params) -> str:
    """The lowered text of a 6-token prefill and of a decode step, with the layer scans set to
    read their weights in place (as a float32 CPU engine's programs are when the kernels are on)."""
    from jfire.models.family import forward, init_cache

    step = jax.jit(lambda p, t, pos, c: forward(p, cfg, t, pos, c))
    cache = init_cache(cfg, 1, 16, jnp.float32)
    with cpu_matmul.in_place(True):
        return "\n".join(
            step.lower(
                params, jnp.ones((1, t), jnp.int32), jnp.arange(6 - t, 6, dtype=jnp.int32)[None], cache
            ).as_text()
            for t in (6, 1)
        )


def take_away_the_compiler(monkeypatch, tmp_path, how: str) -> str:
    """This process as on a machine without a C++ compiler; returns what the warning says why."""
    if how == "CXX names a missing compiler":
        monkeypatch.setenv("CXX", str(tmp_path / "g++"))
        return "was not found"
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory
    return "no C++ compiler found"


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_dir):
    """A tiny SmolLM2: tied embeddings, so its head is a kernel call too."""
    from jfire.checkpoint.load import load_model

    return load_model(str(tiny_hf_dir("smollm2")), "float32")


@pytest.mark.parametrize("how", ["CXX names a missing compiler", "no compiler on PATH"])
def test_without_a_compiler_one_warning_names_both_kernels_and_none_is_called(
    how, monkeypatch, tmp_path, caplog, tiny_model, fresh_traces
):
    """With this machine's library the model's decode step calls all three kernels; where no
    compiler can be found jfire warns once, naming the matmul and the attention kernels and
    why, and nothing calls them: not the model traced to read its weights in place, not the
    engine (its cpu_kernels setting finds them off)."""
    from jfire.runner import uses_cpu_kernels

    assert all(name in lowered_prefill_and_decode(tiny_model.config, tiny_model.params) for name in cpu_matmul.TARGETS)
    jax.clear_caches()
    cpu_matmul.available.cache_clear()
    reason = take_away_the_compiler(monkeypatch, tmp_path, how)
    with caplog.at_level(logging.WARNING, logger="jfire.kernels"):
        text = lowered_prefill_and_decode(tiny_model.config, tiny_model.params)
        assert not uses_cpu_kernels(tiny_model, True)
        q, pages = jnp.zeros((1, 1, 4, 16)), jnp.zeros((2, 1, 4, 16, 16))
        with cpu_matmul.in_place(True):
            assert not cpu_matmul.applies(1, q) and not cpu_attention.applies(q, pages)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "matmul kernels" in warnings[0] and "attention kernel" in warnings[0] and reason in warnings[0]
    assert all(name in warnings[0] for name in cpu_matmul.TARGETS), warnings[0]
    assert not any(name in text for name in cpu_matmul.TARGETS)


def test_without_a_compiler_the_engine_gives_xlas_tokens_and_logprobs(monkeypatch, tmp_path, tiny_model, fresh_traces):
    """An engine left to its default (cpu_kernels on) on a machine without a compiler decodes
    what an engine with the kernels turned off does: the same tokens and logprobs."""
    from jfire.engine import Engine, EngineConfig
    from jfire.sampling import SamplingParams

    take_away_the_compiler(monkeypatch, tmp_path, "no compiler on PATH")
    requests = [([1, 5, 9, 33, 7, 100], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))]
    outputs = []
    for config in (EngineConfig(), EngineConfig(cpu_kernels=False)):
        config = dataclasses.replace(config, max_batch=1, max_prefill_rows=1, aot=False, quick_compile=True)
        with Engine(tiny_model, config) as engine:
            handles = [engine.submit(ids, sp) for ids, sp in requests]
            outputs.append([[(o.token_ids, o.logprobs) for o in h] for h in handles])
    assert outputs[0] == outputs[1]
