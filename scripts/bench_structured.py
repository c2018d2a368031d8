"""What constrained decoding costs per engine step: a batch of requests under a JSON schema
against the same batch free, side by side, alternating.

    .venv/bin/python scripts/bench_structured.py [--batch 16] [--tokens 48] [--rounds 3]

The free wave decodes --tokens tokens per request (EOS ignored); the constrained one at most
that many (a document can end sooner): steps are compared, not waves. Per wave it prints the engine's per-step host time (scheduling and input building,
which includes filling the masks) and device time, and tokens/s; then the constrained wave's
extra host time per step, and what share of a step it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jfire.checkpoint.load import load_model  # noqa: E402
from jfire.engine import Engine, EngineConfig  # noqa: E402
from jfire.grammar import json_schema_grammar  # noqa: E402
from jfire.sampling import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}, "notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "color", "notes"], "additionalProperties": False}


def wave(engine: Engine, prompt: list[int], batch: int, tokens: int, grammar: str | None) -> dict:
    before = engine.stats()
    start = time.perf_counter()
    sampling = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, grammar=grammar,
                               ignore_eos=grammar is None) for i in range(batch)]
    handles = [engine.submit(prompt, sp) for sp in sampling]
    generated = sum(len(h.result().token_ids) for h in handles)
    elapsed = time.perf_counter() - start
    time.sleep(0.05)
    after = engine.stats()
    steps = after["steps"] - before["steps"]
    per_step = {k: (after[f"step_{k}_s"] - before[f"step_{k}_s"]) / steps for k in ("schedule", "prepare", "device")}
    return {"steps": steps, "tokens": generated, "tokens_per_s": generated / elapsed,
            "host_ms_per_step": 1e3 * (per_step["schedule"] + per_step["prepare"]),
            "device_ms_per_step": 1e3 * per_step["device"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model = load_model("default", "float32")
    config = EngineConfig(max_batch=args.batch, max_prefill_rows=args.batch, prefill_budget=256, max_model_len=512,
                          aot=False)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    grammar = json_schema_grammar(SCHEMA)
    results: dict[str, list[dict]] = {"free": [], "constrained": []}
    with Engine(model, config) as engine:
        wave(engine, prompt, args.batch, 4, None)  # compile the shapes both waves use
        wave(engine, prompt, args.batch, 4, grammar)
        for _ in range(args.rounds):
            for kind in ("free", "constrained"):
                results[kind].append(wave(engine, prompt, args.batch, args.tokens, None if kind == "free" else grammar))
    summary = {kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in results.items()}
    for kind, s in summary.items():
        print(f"{kind:11s}: host {s['host_ms_per_step']:6.2f} ms/step, device {s['device_ms_per_step']:6.1f} ms/step, "
              f"{s['tokens_per_s']:6.1f} tokens/s (batch {args.batch}, median of {args.rounds})")
    extra = summary["constrained"]["host_ms_per_step"] - summary["free"]["host_ms_per_step"]
    step = summary["free"]["host_ms_per_step"] + summary["free"]["device_ms_per_step"]
    print(f"masks for {args.batch} rows: +{extra:.2f} ms of host time per step ({100 * extra / step:.1f}% of a step)")
    if args.output:
        Path(args.output).write_text(json.dumps({"config": vars(args), "runs": results, "median": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
