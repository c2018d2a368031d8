"""Colocated vs disaggregated serving under a mixed load, side by side.

    .venv/bin/python scripts/bench_disagg.py [--seconds 60] [--steady 3] [--burst 3]
        [--burst-every 6] [--long-prompt 480] [--output bench-disagg.json]

The load: `--steady` clients each streaming short-prompt requests back to back (the decode
traffic whose time per token we care about), plus every `--burst-every` seconds a burst of
`--burst` long prompts (prefill work). The same load runs against
  colocated:      `jfire serve` (prefill and decode in one process), on cores 0-1;
  disaggregated:  `jfire launch local-1p1d`, the prefill process pinned to core 0 and the
                  decode process to core 1 (standing for two machines).
It prints p50/p99 of time per output token (per request, and every gap between streamed
tokens) and of TTFT for both kinds of request. On one 2-core machine both modes get the same
two cores; what splits is who waits for whom.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jfire.deployment_secret import DeploymentSecret, to_env  # noqa: E402
from jfire.disagg.launch import free_port  # noqa: E402

# The deployment's secret, as an operator gives one: its control token shows /health's group pids.
SECRET = DeploymentSecret.generate()

ENGINE_ARGS = ["--max-batch", "8", "--prefill-budget", "256", "--max-context", "1024", "--kv-cache-gb", "0.2"]
SHORT_PROMPT = "Describe a walk through a quiet forest in early morning."
LONG_UNIT = "The history of the city is long and full of stories about merchants, sailors and builders. "


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 900) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            r = httpx.get(url + "/health", headers={"Authorization": f"Bearer {SECRET.bearer()}"}, timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server not ready in time")


def pin(pid: int, cores: str) -> None:
    """Pins every thread of a process (threads made later inherit it)."""
    subprocess.run(["taskset", "-a", "-p", "-c", cores, str(pid)], check=True, capture_output=True)


def stream_one(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: arrival times of its tokens."""
    t0 = time.perf_counter()
    times = []
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(line)
                times.append(time.perf_counter())
    return {"ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])],
            "tpot": (times[-1] - times[0]) / max(1, len(times) - 1)}


def run_load(url: str, args) -> dict:
    stop = threading.Event()
    steady, long = [], []
    lock = threading.Lock()

    def steady_client():
        while not stop.is_set():
            result = stream_one(url, SHORT_PROMPT, args.steady_tokens)
            with lock:
                steady.append(result)

    def burst(i):
        result = stream_one(url, f"Burst {i}. " + LONG_UNIT * (args.long_prompt // 17), 4)
        with lock:
            long.append(result)

    threads = [threading.Thread(target=steady_client, daemon=True) for _ in range(args.steady)]
    for t in threads:
        t.start()
    bursts, t_start, n = [], time.time(), 0
    while time.time() - t_start < args.seconds:
        time.sleep(args.burst_every)
        for _ in range(args.burst):
            b = threading.Thread(target=burst, args=(n,), daemon=True)
            n += 1
            b.start()
            bursts.append(b)
    stop.set()
    for t in threads + bursts:
        t.join(timeout=600)
    gaps = [g for r in steady for g in r["gaps"]]
    tpots = [r["tpot"] for r in steady]
    return {
        "steady_requests": len(steady), "long_requests": len(long),
        "tpot_p50_ms": 1e3 * percentile(tpots, 50), "tpot_p99_ms": 1e3 * percentile(tpots, 99),
        "token_gap_p50_ms": 1e3 * percentile(gaps, 50), "token_gap_p99_ms": 1e3 * percentile(gaps, 99),
        "steady_ttft_p50_ms": 1e3 * percentile([r["ttft"] for r in steady], 50),
        "steady_ttft_p99_ms": 1e3 * percentile([r["ttft"] for r in steady], 99),
        "long_ttft_p50_ms": 1e3 * percentile([r["ttft"] for r in long], 50),
        "long_ttft_p99_ms": 1e3 * percentile([r["ttft"] for r in long], 99),
        "output_tokens_per_s": sum(len(r["gaps"]) + 1 for r in steady) / args.seconds,
    }


def start(mode: str, port: int, log: Path) -> tuple[subprocess.Popen, str]:
    py = [sys.executable, "-m", "jfire.cli"]
    if mode == "colocated":
        cmd = ["taskset", "-c", "0,1", *py, "serve", "--port", str(port), *ENGINE_ARGS]
    else:
        cmd = [*py, "launch", "local-1p1d", "--port", str(port), *ENGINE_ARGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **to_env(SECRET)}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            start_new_session=True), f"http://127.0.0.1:{port}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--steady", type=int, default=3, help="clients streaming short requests back to back")
    p.add_argument("--steady-tokens", type=int, default=64)
    p.add_argument("--burst", type=int, default=3, help="long prompts per burst")
    p.add_argument("--burst-every", type=float, default=6.0)
    p.add_argument("--long-prompt", type=int, default=480, help="approximate tokens per long prompt")
    p.add_argument("--modes", default="colocated,disaggregated")
    p.add_argument("--output", default="bench-disagg.json")
    args = p.parse_args()
    results = {}
    for mode in args.modes.split(","):
        process, url = start(mode, free_port(), Path(f"/tmp/jfire-bench-{mode}.log"))
        try:
            health = wait_ready(url, process)
            if mode == "disaggregated":
                groups = health["groups"]
                pin(next(g["pid"] for g in groups.values() if g["role"] == "prefill"), "0")
                pin(next(g["pid"] for g in groups.values() if g["role"] == "decode"), "1")
            for _ in range(2):  # warm-up: first requests through every path
                stream_one(url, SHORT_PROMPT, 8)
                stream_one(url, LONG_UNIT * (args.long_prompt // 17), 2)
            print(f"{mode}: running the mixed load for {args.seconds:g} s ...", file=sys.stderr, flush=True)
            results[mode] = run_load(url, args)
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    keys = list(next(iter(results.values())))
    print(f"{'':24}" + "".join(f"{m:>16}" for m in results))
    for k in keys:
        print(f"{k:24}" + "".join(f"{results[m][k]:16.1f}" for m in results))
    Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
