"""`jfire bench --compare`: jfire, llama.cpp and transformers side by side on the default model.

Every engine runs the same measurements in a fresh process of its own, and the engines take
turns round after round (jfire, llama.cpp F32, llama.cpp Q4_1, transformers, then again), so
a noisy neighbour slows all of them rather than one; the table reports each figure's median
over the rounds. A program that prints figures, not a test.

- llama.cpp reads the same weights jfire serves: the default model's Q4_1 GGUF dequantized
  and written back as an F32 GGUF (`write_f32_gguf`, the values jfire's loader produces). The
  original Q4_1 file runs too, for reference: it reads 1/6 of the bytes per token.
- transformers loads the same GGUF in float32 (as the test suite's reference does).
- The roofline: batch-1 decode reads every weight once per token, so tokens/s can be at most
  this machine's memory bandwidth (measured here: a large array reduction, once every round
  beside the engines, and the median taken) over the model's bytes. Each engine's decode rate
  is also given as a fraction of it.

Measured per engine, per round (`measure_engine` in the child process):
  startup_s    launch of the process to its first generated token (a one-token request);
               jfire's first round starts with an empty compilation cache (cold), the
               later rounds reuse it (warm)
  ttft_s       time to the first token of a 512-token prompt
  decode_tps   batch-1 decode tokens/s over 128 tokens after that prompt
  conc16_tps   output tokens/s for 16 requests of 128-token prompts and 128 new tokens each,
               submitted at once (llama.cpp: its batch-1 rate, one sequence at a time;
               transformers: one batched `generate` of 16)
  peak_rss_gb  the process's peak resident memory
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT_LEN, DECODE_TOKENS, CONC, CONC_PROMPT, CONC_TOKENS = 512, 128, 16, 128, 128
ENGINES = ("jfire", "llama.cpp F32", "llama.cpp Q4_1", "transformers")
FIRST_TOKEN = "FIRST-TOKEN"  # the child prints this once its first request has produced a token


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """The GGUF at src with every tensor dequantized to float32, metadata unchanged (file type
    set to all-F32): the same values jfire loads from src, in a file llama.cpp reads."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        value = int(gguf.LlamaFileType.ALL_F32) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(
            field.name, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        )
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def memory_bandwidth_gbs(gib: float = 1.0, repeats: int = 7) -> float:
    """Read bandwidth: the best of several reductions over a float32 array much larger than
    the caches (XLA's CPU reduction runs on every core)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def prompts(vocab: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """The 512-token prompt and the 16 concurrent 128-token prompts (random ids, no EOS) for
    llama.cpp and transformers; jfire's come from `jfire bench`'s own waves, drawn alike."""
    rng = np.random.default_rng(seed)
    one = [int(x) for x in rng.integers(100, vocab, PROMPT_LEN)]
    many = [[int(x) for x in rng.integers(100, vocab, CONC_PROMPT)] for _ in range(CONC)]
    return one, many


# -- the engines, each measured in its own process ------------------------------------------------


def _jfire(cache_dir: str) -> dict:
    from jfire.bench import run_wave
    from jfire.checkpoint.load import load_model
    from jfire.engine import Engine, EngineConfig
    from jfire.sampling import SamplingParams

    model = load_model("default", "float32")
    config = EngineConfig(max_batch=CONC, max_model_len=1024, compilation_cache_dir=cache_dir)
    with Engine(model, config) as engine:
        engine.generate([([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))])
        print(FIRST_TOKEN, flush=True)
        engine.wait_compiled()  # the rest measures serving, not background compilation
        alone = run_wave(engine, 1, PROMPT_LEN, DECODE_TOKENS + 1, seed=0)
        together = run_wave(engine, CONC, CONC_PROMPT, CONC_TOKENS, seed=1)
    return {
        "ttft_s": alone["ttft_s"]["p50"],
        "decode_tps": 1 / alone["tpot_s"]["p50"],
        "conc16_tps": together["output_tokens_per_s"],
    }


def _llama_cpp(path: str) -> dict:
    from llama_cpp import Llama

    threads = os.cpu_count()
    llm = Llama(
        model_path=path, n_ctx=1024, n_batch=PROMPT_LEN, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    vocab = llm.n_vocab()

    def next_token() -> int:  # greedy, from the last evaluated position's logits
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))

    def greedy_after(ids: list[int], new: int) -> tuple[float, float]:
        """(seconds to the first token, decode tokens/s of the rest)."""
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        token = next_token()
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(new):
            llm.eval([token])
            token = next_token()
        return first, new / (time.perf_counter() - t)

    greedy_after([1, 2, 3], 0)
    print(FIRST_TOKEN, flush=True)
    one, _ = prompts(vocab)
    ttft, tps = greedy_after(one, DECODE_TOKENS)
    # One sequence at a time: llama.cpp's batch-1 rate is what the concurrency-16 figure of
    # the other engines is compared with.
    return {"ttft_s": ttft, "decode_tps": tps, "conc16_tps": tps}


def _transformers() -> dict:
    import torch
    import transformers

    from jfire.checkpoint.default_model import GGUF_NAME, default_gguf_path

    torch.set_num_threads(os.cpu_count())
    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=GGUF_NAME, dtype=torch.float32
    ).eval()
    vocab = model.config.vocab_size

    def generate(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    generate([[1, 2, 3]], 1)
    print(FIRST_TOKEN, flush=True)
    one, many = prompts(vocab)
    ttft = generate([one], 1)
    total = generate([one], DECODE_TOKENS + 1)
    conc = generate(many, CONC_TOKENS)
    return {
        "ttft_s": ttft,
        "decode_tps": DECODE_TOKENS / max(total - ttft, 1e-9),
        "conc16_tps": CONC * CONC_TOKENS / conc,
    }


def measure_engine(engine: str, arg: str) -> dict:
    """Runs in the child: one engine's figures, with this process's peak RSS."""
    if engine == "jfire":
        out = _jfire(arg)
    elif engine.startswith("llama.cpp"):
        out = _llama_cpp(arg)
    else:
        out = _transformers()
    out["peak_rss_gb"] = peak_rss_bytes() / 1e9
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started its program (VmHWM; getrusage's
    ru_maxrss would include the parent's memory at the fork)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def _run_child(engine: str, arg: str) -> dict:
    """One engine in a fresh process: its figures, plus launch-to-first-token."""
    cmd = [sys.executable, "-m", "jfire.bench_compare", engine, arg]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    startup = None
    lines = []
    for line in child.stdout:
        if line.strip() == FIRST_TOKEN and startup is None:
            startup = time.perf_counter() - start
        else:
            lines.append(line)
    if child.wait() != 0 or startup is None:
        raise RuntimeError(f"the {engine} measurement failed (exit {child.returncode}):\n{''.join(lines)[-2000:]}")
    return {**json.loads(lines[-1]), "startup_s": startup}


# -- the comparison ------------------------------------------------------------------------


def run_compare(rounds: int, output: str | None, chart: str | None, engines=ENGINES) -> dict:
    from jfire.checkpoint.default_model import default_gguf_path
    from jfire.checkpoint.load import load_config_and_tokenizer

    q4 = default_gguf_path()
    work = Path(tempfile.mkdtemp(prefix="jfire-compare-"))
    f32 = write_f32_gguf(q4, work / "default-f32.gguf")
    cache = str(work / "xla-cache")
    # Every weight once, in float32 (the tied embedding is read once, by the output layer).
    model_bytes = sum(4 * int(np.prod(spec.shape)) for spec in load_config_and_tokenizer("default")[0].param_specs())
    args = {"jfire": cache, "llama.cpp F32": str(f32), "llama.cpp Q4_1": str(q4), "transformers": ""}
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    bandwidths = []
    for r in range(rounds):
        # The bandwidth moves with the neighbours on the host as much as the engines' rates do
        # (29-47 GB/s on one day here): measured once a round, beside them, and the median taken.
        bandwidths.append(memory_bandwidth_gbs())
        print(f"round {r + 1} memory bandwidth: {bandwidths[-1]:.1f} GB/s", flush=True)
        for engine in engines:
            figures = _run_child(engine, args[engine])
            runs[engine].append(figures)
            print(f"round {r + 1} {engine}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()), flush=True)
    bandwidth = statistics.median(bandwidths)
    roofline = bandwidth * 1e9 / model_bytes
    print(
        f"memory bandwidth {bandwidth:.1f} GB/s (median of the rounds); float32 model {model_bytes / 1e6:.0f} MB "
        f"-> batch-1 decode roofline {roofline:.1f} tokens/s",
        flush=True,
    )
    summary = {}
    for engine, rs in runs.items():
        s = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        if engine == "jfire":  # the first launch compiled everything; the rest loaded the cache
            s["startup_s"] = statistics.median(x["startup_s"] for x in rs[1:]) if len(rs) > 1 else rs[0]["startup_s"]
            s["startup_cold_s"] = rs[0]["startup_s"]
        s["roofline_fraction"] = s["decode_tps"] / roofline
        summary[engine] = s
    results = {
        "machine": _machine(),
        "bandwidth_gbs": bandwidth,
        "bandwidth_runs_gbs": bandwidths,
        "model_bytes": model_bytes,
        "roofline_decode_tps": roofline,
        "rounds": rounds,
        "runs": runs,
        "median": summary,
    }
    print(format_compare(results))
    if output:
        with open(output, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {output}")
    if chart:
        plot_compare(results, chart)
        print(f"wrote {chart}")
    return results


def _machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"
    )
    return f"{os.cpu_count()} cores, {model}"


def format_compare(results: dict) -> str:
    m = results["median"]
    head = (
        f"{'engine':<16}{'start-up':>20}{'TTFT 512':>10}{'decode b1':>12}{'of roofline':>12}{'conc 16':>12}"
        f"{'peak RSS':>10}"
    )
    lines = [head, "-" * len(head)]
    for engine, s in m.items():
        start = (f"({s['startup_cold_s']:.1f} s cold) " if "startup_cold_s" in s else "") + f"{s['startup_s']:.1f} s"
        lines.append(
            f"{engine:<16}{start:>20}{s['ttft_s'] * 1e3:>7.0f} ms{s['decode_tps']:>8.1f} t/s"
            f"{100 * s['roofline_fraction']:>11.0f}%{s['conc16_tps']:>8.1f} t/s{s['peak_rss_gb']:>7.2f} GB"
        )
    lines.append(
        f"roofline (batch-1 decode, float32): {results['roofline_decode_tps']:.1f} tokens/s at "
        f"{results['bandwidth_gbs']:.1f} GB/s; medians of {results['rounds']} alternating rounds; "
        f"{results['machine']}"
    )
    return "\n".join(lines)


def plot_compare(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = results["median"]
    engines = list(m)
    panels = [
        ("TTFT, 512-token prompt (s)", "ttft_s"),
        ("batch-1 decode (tokens/s)", "decode_tps"),
        ("16 concurrent requests (output tokens/s;\nllama.cpp: one at a time)", "conc16_tps"),
        ("launch to first token (s)", "startup_s"),
        ("peak RSS (GB)", "peak_rss_gb"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, key) in zip(axes, panels):
        ax.bar(range(len(engines)), [m[e][key] for e in engines], color=["C0", "C1", "C2", "C3"][: len(engines)])
        ax.set_xticks(range(len(engines)), engines, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        if key == "decode_tps":
            ax.axhline(results["roofline_decode_tps"], color="k", linestyle="--", linewidth=1)
            ax.text(0, results["roofline_decode_tps"], " float32 roofline", va="bottom", fontsize=7)
    fig.suptitle(f"default model (SmolLM2-135M), {results['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    print(json.dumps(measure_engine(sys.argv[1], sys.argv[2])), flush=True)
