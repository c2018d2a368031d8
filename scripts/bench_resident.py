"""Batch-1 greedy decode of the default model held three ways, side by side in one process:
float32, bfloat16 (`--dtype bfloat16`) and bfloat16 palette-coded (`--keep-compressed`).

    python scripts/bench_resident.py [--contexts 32,512] [--rounds 10] [--output FILE]

The three engines run in one process and take turns request by request, so the machine's
drift (its memory bandwidth moves by a third between days) falls on all three alike. Each
round sends every engine the same prompt of random tokens and decodes 96 tokens (EOS ignored);
tokens/s is 95 over the time from first to last token; the first 2 rounds (compiles) are
dropped and the median of the rest reported, with the ratios the compression work is held to
(bfloat16 over float32, coded over bfloat16) and whether the coded engine gave bfloat16's tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from jfire.checkpoint.load import load_model  # noqa: E402
from jfire.engine import Engine, EngineConfig  # noqa: E402
from jfire.sampling import SamplingParams  # noqa: E402

NEW_TOKENS, WARMUP = 96, 2
HOLDINGS = {"float32": ("float32", False), "bfloat16": ("bfloat16", False), "coded": ("bfloat16", True)}


def measure(engines: dict, context: int, rounds: int, seed: int = 0) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rng = np.random.default_rng(seed)
    rates: dict = {name: [] for name in engines}
    same = True
    for r in range(rounds + WARMUP):
        prompt = [int(t) for t in rng.integers(100, 40000, context)]
        tokens = {}
        for name, engine in engines.items():
            done = engine.generate([(prompt, greedy)])[0]
            tokens[name] = done.token_ids
            if r >= WARMUP:
                rates[name].append((NEW_TOKENS - 1) / (done.latency_s - done.ttft_s))
        same = same and tokens["coded"] == tokens["bfloat16"]
    median = {name: statistics.median(v) for name, v in rates.items()}
    return {"context": context, "tokens_per_s": median, "rounds": rates, "coded_tokens_equal_bfloat16": same,
            "bfloat16_over_float32": median["bfloat16"] / median["float32"],
            "coded_over_bfloat16": median["coded"] / median["bfloat16"]}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32,512", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per context (after 2 dropped)")
    ap.add_argument("--output", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    config = EngineConfig(max_batch=4, max_model_len=1024)
    engines = {name: Engine(load_model("default", dtype, keep_compressed=coded), config).start()
               for name, (dtype, coded) in HOLDINGS.items()}  # fmt: skip
    for engine in engines.values():
        # Decode is measured, not the programs each engine compiles in the background after
        # start() (they would share the cores with the first timed rounds).
        engine.wait_compiled()
    results = []
    try:
        for context in (int(c) for c in args.contexts.split(",")):
            r = measure(engines, context, args.rounds)
            results.append(r)
            rates = ", ".join(f"{name} {r['tokens_per_s'][name]:.1f}" for name in engines)
            print(
                f"context {context:>4}: {rates} tok/s; bfloat16/float32 {r['bfloat16_over_float32']:.3f}, "
                f"coded/bfloat16 {r['coded_over_bfloat16']:.3f}; coded tokens = bfloat16's: "
                f"{'yes' if r['coded_tokens_equal_bfloat16'] else 'NO'}",
                flush=True,
            )
    finally:
        for engine in engines.values():
            engine.shutdown()
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0 if all(r["coded_tokens_equal_bfloat16"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
