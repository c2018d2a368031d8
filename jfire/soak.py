"""A soak: bounded mixed agent traffic against a running `jfire serve` or `jfire launch`, with
every process's memory, file descriptors and threads sampled over time.

The traffic (4-8 clients at once, the number changing every 30 s): streaming and non-streaming
chat and completions with max_tokens 1-128, JSON-schema outputs, tool calls (auto and forced),
n=2, logprobs, a few long prompts repeated (prefix hits), prompts filling the context to its
limit, clients that leave mid-stream (10%) and malformed requests (5%, each with its one right
4xx answer). A fixed probe (greedy) runs every `probe_s`: its text must never change.

What it reports: requests by kind and outcome; 5xx answers and error events in 200 streams by
cause (with hex numbers blanked, so one cause is one line); client-side failures; the
deployment's transfer counters; per process RSS, descriptors and threads over time with a
linear fit of RSS after `warmup_s`; and, once the load has stopped, the pages still held and
pulls still running. Everything is bounded: each client stops at the deadline, each request
has a timeout, and it only talks to the URL it is given (loopback in practice).

`scripts/soak.py` starts the deployments and runs this for minutes; the fault suite runs a
short form (tests/reliability/test_disagg_faults.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import re
import statistics
import threading
import time
from pathlib import Path

import httpx

MIB = 1 << 20
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near "
    "old river banks under grey autumn skies and every careful engineer writes small tests first"
).split()
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
PROBE = {"messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": 24, "temperature": 0}
# (name, weight): the mix of request kinds each client draws from.
KINDS = [
    ("completion", 12),
    ("chat", 12),
    ("json_schema", 8),
    ("tool_auto", 6),
    ("tool_required", 8),
    ("n2", 6),
    ("logprobs", 8),
    ("long_repeat", 12),
    ("near_limit", 6),
    ("leave", 10),
    ("malformed", 5),
]
MALFORMED = [  # (body as sent, endpoint): each must be refused with a 4xx
    (b'{"model": "default", "prompt": "hi", ', "/v1/completions"),
    (json.dumps({"model": "default", "prompt": "hi", "max_tokens": -1}).encode(), "/v1/completions"),
    (json.dumps({"model": "default", "messages": "hi"}).encode(), "/v1/chat/completions"),
    (json.dumps({"model": "default", "prompt": "hi", "temperature": "hot"}).encode(), "/v1/completions"),
    (
        json.dumps({"model": "default", "messages": [{"role": "user", "content": "x"}], "n": 0}).encode(),
        "/v1/chat/completions",
    ),
    (json.dumps({"model": "default", "prompt": [10**9]}).encode(), "/v1/completions"),
]


@dataclasses.dataclass
class SoakConfig:
    duration_s: float = 720.0
    context: int = 2048  # the server's --max-context
    min_clients: int = 4
    max_clients: int = 8
    clients_period_s: float = 30.0  # how often the number of active clients changes
    sample_s: float = 30.0  # a logged sample: counters and processes
    rss_sample_s: float = 5.0  # processes alone, for the fit (a transfer in flight moves RSS by tens of MiB)
    probe_s: float = 30.0
    warmup_s: float = 120.0  # RSS is fitted on samples after this
    seed: int = 0
    request_timeout_s: float = 300.0
    idle_timeout_s: float = 60.0  # how long pages may take to come back once the load stops


def cause(message: str) -> str:
    """An error message with its numbers and ids blanked: one line per cause."""
    return re.sub(r"0x[0-9a-f]+|\b[0-9a-f]{16,}\b|cmpl-\w+|chatcmpl-\w+|\d+(\.\d+)?", "#", message)[:200]


class Tally:
    """What the clients saw, by kind and outcome (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.outcomes: collections.Counter = collections.Counter()  # (kind, outcome)
        self.server_errors: collections.Counter = collections.Counter()  # 5xx cause
        self.stream_errors: collections.Counter = collections.Counter()  # error event cause
        self.client_errors: collections.Counter = collections.Counter()  # exceptions on our side
        self.wrong_refusals: collections.Counter = (
            collections.Counter()
        )  # a 4xx to a valid request, or not to a bad one
        self.probes: list[str] = []

    def add(self, kind: str, outcome: str, counter: str | None = None, why: str = "") -> None:
        with self._lock:
            self.outcomes[(kind, outcome)] += 1
            if counter is not None:
                getattr(self, counter)[why] += 1

    def add_probe(self, text: str) -> None:
        with self._lock:
            self.probes.append(text)

    def summary(self) -> dict:
        with self._lock:
            by_kind: dict = collections.defaultdict(dict)
            for (kind, outcome), n in sorted(self.outcomes.items()):
                by_kind[kind][outcome] = n
            return {
                "requests": sum(self.outcomes.values()),
                "by_kind": dict(by_kind),
                "5xx": sum(self.server_errors.values()),
                "5xx_by_cause": dict(self.server_errors),
                "stream_errors": sum(self.stream_errors.values()),
                "stream_errors_by_cause": dict(self.stream_errors),
                "client_errors": sum(self.client_errors.values()),
                "client_errors_by_cause": dict(self.client_errors),
                "wrong_refusals": sum(self.wrong_refusals.values()),
                "wrong_refusals_by_cause": dict(self.wrong_refusals),
                "probes": len(self.probes),
                "probe_outputs": sorted(set(self.probes)),
            }


def http_client(timeout: float | httpx.Timeout) -> httpx.Client:
    """An HTTP client that lets an idle connection go before the server does. uvicorn closes one
    after 5 s idle and httpx keeps one 5 s by default, so a request sent at that moment went out
    on a connection the server was closing ("Server disconnected without sending a response"):
    a loss the soak would count against the deployment."""
    return httpx.Client(timeout=timeout, limits=httpx.Limits(keepalive_expiry=2.0))


class Client:
    """One simulated client: draws a request kind, sends it, classifies what came back."""

    def __init__(self, url: str, config: SoakConfig, tally: Tally, rng: random.Random, long_prompts: list[str]):
        self.url, self.config, self.tally, self.rng = url, config, tally, rng
        self.long_prompts = long_prompts
        self.http = http_client(httpx.Timeout(30.0, read=config.request_timeout_s))

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def request(self, kind: str) -> tuple[str, dict, bool, int | None]:
        """(endpoint, body, stream, chunks to read before leaving or None)."""
        r = self.rng
        chat = {
            "model": "default",
            "messages": [{"role": "user", "content": self.words(r.randint(3, 60))}],
            "max_tokens": r.randint(1, 128),
            "temperature": r.choice([0, 0.7]),
        }
        stream = r.random() < 0.5
        if kind == "completion":
            return (
                "/v1/completions",
                {
                    "model": "default",
                    "prompt": self.words(r.randint(3, 300)),
                    "max_tokens": r.randint(1, 128),
                    "temperature": r.choice([0, 0.8]),
                },
                stream,
                None,
            )
        if kind == "chat":
            return "/v1/chat/completions", chat, stream, None
        if kind == "json_schema":
            return (
                "/v1/chat/completions",
                {
                    **chat,
                    "max_tokens": r.randint(16, 128),
                    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                },
                stream,
                None,
            )
        if kind in ("tool_auto", "tool_required"):
            choice = "auto" if kind == "tool_auto" else "required"
            return "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": choice}, stream, None
        if kind == "n2":
            return (
                "/v1/completions",
                {
                    "model": "default",
                    "prompt": self.words(r.randint(3, 100)),
                    "n": 2,
                    "max_tokens": r.randint(1, 64),
                    "temperature": 0.8,
                },
                stream,
                None,
            )
        if kind == "logprobs":
            return "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}, stream, None
        if kind == "long_repeat":
            return (
                "/v1/completions",
                {
                    "model": "default",
                    "prompt": r.choice(self.long_prompts),
                    "max_tokens": r.randint(1, 32),
                    "temperature": 0,
                },
                stream,
                None,
            )
        if kind == "near_limit":  # token ids, so the length is exact: the context filled to its last token
            max_tokens = r.randint(1, 16)
            n = self.config.context - max_tokens - r.randint(0, 8)
            prompt = [r.randrange(1000, 20000) for _ in range(n)]
            return (
                "/v1/completions",
                {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                stream,
                None,
            )
        if kind == "leave":
            return "/v1/chat/completions", {**chat, "max_tokens": 128}, True, r.randint(1, 6)
        raise ValueError(kind)

    def run(self, kind: str) -> None:
        if kind == "malformed":
            return self.malformed()
        path, body, stream, leave_after = self.request(kind)
        try:
            if stream:
                self.streamed(kind, path, {**body, "stream": True}, leave_after)
            else:
                self.whole(kind, path, body)
        except httpx.HTTPError as e:
            self.tally.add(kind, "client_error", "client_errors", f"{type(e).__name__}: {cause(str(e))}")

    def classify_status(self, kind: str, status: int, text: str) -> bool:
        """Counts a non-200 answer; True if the answer was 200."""
        if status == 200:
            return True
        message = text
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        if status >= 500:
            self.tally.add(kind, f"{status}", "server_errors", f"{status} {cause(message)}")
        elif status == 429:
            self.tally.add(kind, "429")  # overload is a right answer to too much traffic
        else:
            self.tally.add(kind, f"{status}", "wrong_refusals", f"{status} to a valid request: {cause(message)}")
        return False

    def whole(self, kind: str, path: str, body: dict) -> None:
        r = self.http.post(self.url + path, json=body)
        if self.classify_status(kind, r.status_code, r.text):
            self.tally.add(kind, "ok")

    def streamed(self, kind: str, path: str, body: dict, leave_after: int | None) -> None:
        with self.http.stream("POST", self.url + path, json=body) as r:
            if not self.classify_status(kind, r.status_code, r.read().decode() if r.status_code != 200 else ""):
                return
            chunks, done = 0, False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    self.tally.add(kind, "stream_error", "stream_errors", cause(event["error"].get("message", "")))
                    return
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    self.tally.add(kind, "left")
                    return  # leaving the block closes the connection mid-stream
        if done or leave_after is not None:
            self.tally.add(kind, "ok")
        else:
            self.tally.add(kind, "stream_error", "stream_errors", "the stream ended without [DONE]")

    def malformed(self) -> None:
        body, path = self.rng.choice(MALFORMED)
        try:
            r = self.http.post(self.url + path, content=body, headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            self.tally.add("malformed", "client_error", "client_errors", f"{type(e).__name__}: {cause(str(e))}")
            return
        if 400 <= r.status_code < 500:
            self.tally.add("malformed", "refused")
        elif r.status_code >= 500:
            self.tally.add("malformed", str(r.status_code), "server_errors", f"{r.status_code} to a malformed request")
        else:
            self.tally.add("malformed", str(r.status_code), "wrong_refusals", f"{r.status_code} to a malformed request")


# -- what the processes hold --------------------------------------------------------------------


def process_sample(pid: int) -> dict | None:
    """RSS (MiB), open descriptors and threads of a live process, or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "fds": fds, "threads": int(fields["Threads"])}


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


class Deployment:
    """The processes behind a URL and the server-side counters the soak reads."""

    def __init__(
        self,
        url: str,
        *,
        server_pid: int | None = None,
        launcher_pid: int | None = None,
        control_headers: dict | None = None,
    ):
        """`control_headers`: a deployment's control token (jfire.deployment_secret's bearer), which
        /health needs to show where its groups are, and their control routes to answer."""
        self.url, self.server_pid, self.launcher_pid = url, server_pid, launcher_pid
        self.control_headers = control_headers or {}
        self.http = http_client(10.0)

    def groups(self) -> dict:
        if self.launcher_pid is None:
            return {}
        return self.http.get(self.url + "/health", headers=self.control_headers).json().get("groups", {})

    def processes(self) -> dict[str, int]:
        """name -> pid: the server; or the frontend and every group of a deployment."""
        if self.launcher_pid is None:
            return {"serve": self.server_pid}
        found = {}
        for pid in children(self.launcher_pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--process-id" in cmdline and cmdline[cmdline.index(b"--process-id") + 1] == b"0":
                found["frontend"] = pid
        found.update({name: g["pid"] for name, g in sorted(self.groups().items())})
        return found

    def counters(self) -> dict:
        """Pages held, pulls running and transfer counts, per group (or for the one server)."""
        if self.launcher_pid is None:
            metrics = self.http.get(self.url + "/metrics").text
            value = next(
                float(line.split()[1]) for line in metrics.splitlines() if line.startswith("jfire_kv_pages_used ")
            )
            return {"serve": {"pages_used": int(value)}}
        keys = (
            "pages_used",
            "transfers_pending",
            "pull_threads",
            "transfers_failed",
            "transfers_corrupted",
            "last_transfer_error",
            "kv_transfers",
            "transfers_published",
            "transfers_expired",
            "compiled_programs",
        )
        out = {}
        for name, g in self.groups().items():
            stats = self.http.get(g["control"] + "/stats", headers=self.control_headers).json()
            out[name] = {k: stats[k] for k in keys if k in stats}
        return out


def fit(times: list[float], values: list[float]) -> dict:
    """Least-squares slope of values over times (s), per 10 minutes, with its standard error
    and the correlation."""
    n = len(times)
    if n < 3 or len(set(values)) < 2:
        return {"per_10_min": 0.0, "stderr_per_10_min": 0.0, "r": 0.0, "samples": n}
    slope, intercept = statistics.linear_regression(times, values)
    residual = sum((v - (intercept + slope * t)) ** 2 for t, v in zip(times, values)) / (n - 2)
    spread = sum((t - statistics.fmean(times)) ** 2 for t in times)
    return {
        "per_10_min": slope * 600,
        "stderr_per_10_min": (residual / spread) ** 0.5 * 600,
        "r": statistics.correlation(times, values),
        "samples": n,
    }


def minima(times: list[float], values: list[float], window_s: float = 60.0) -> tuple[list[float], list[float]]:
    """The lowest value of each window (at the window's middle): RSS without the transfers
    and batches that happened to be in flight at a sample."""
    windows: dict[int, float] = {}
    for t, v in zip(times, values):
        k = int(t // window_s)
        windows[k] = min(v, windows.get(k, v))
    keys = sorted(windows)
    return [(k + 0.5) * window_s for k in keys], [windows[k] for k in keys]


def run(deployment: Deployment, config: SoakConfig, *, log=print) -> dict:
    """Runs the soak and returns its report (also logged a line per sample as it goes)."""
    tally, stop = Tally(), threading.Event()
    rng = random.Random(config.seed)
    long_prompts = [
        " ".join(rng.choice(WORDS) for _ in range(min(900, config.context // 3))) + f" ({i})" for i in range(3)
    ]
    start = time.monotonic()
    deadline = start + config.duration_s

    def active_clients(now: float) -> int:
        span = config.max_clients - config.min_clients + 1
        return config.min_clients + int((now - start) // config.clients_period_s) % span

    def client_loop(i: int) -> None:
        client = Client(deployment.url, config, tally, random.Random(config.seed * 1000 + i), long_prompts)
        kinds, weights = zip(*KINDS)
        while time.monotonic() < deadline and not stop.is_set():
            if i >= active_clients(time.monotonic()):
                time.sleep(0.5)
                continue
            client.run(client.rng.choices(kinds, weights)[0])

    def probe_loop() -> None:
        http = http_client(config.request_timeout_s)
        while time.monotonic() < deadline and not stop.is_set():
            t0 = time.monotonic()
            try:
                r = http.post(deployment.url + "/v1/chat/completions", json={"model": "default", **PROBE})
                text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}"
            except (httpx.HTTPError, ValueError, KeyError) as e:
                text = f"{type(e).__name__}"
            tally.add_probe(text)
            stop.wait(max(0.0, config.probe_s - (time.monotonic() - t0)))

    samples: list[dict] = []
    rss_series: dict[str, list[tuple[float, dict]]] = collections.defaultdict(list)

    def rss_loop() -> None:
        while not stop.wait(config.rss_sample_s):
            t = time.monotonic() - start
            for name, pid in deployment.processes().items():
                if (p := process_sample(pid)) is not None:
                    rss_series[name].append((t, p))

    def sample() -> None:
        t = time.monotonic() - start
        procs = {name: process_sample(pid) for name, pid in deployment.processes().items()}
        counters = deployment.counters()
        samples.append({"t": t, "processes": procs, "counters": counters})
        rss = ", ".join(
            f"{n} {p['rss_mb']:.0f} MiB/{p['fds']} fds/{p['threads']} threads" for n, p in procs.items() if p
        )
        summary = tally.summary()
        log(
            f"soak: t={t:5.0f} s  {summary['requests']} requests, {summary['5xx']} 5xx, "
            f"{summary['stream_errors']} stream errors; {rss}"
        )

    sample()
    before = samples[0]
    threads = [
        threading.Thread(target=client_loop, args=(i,), name=f"soak-client-{i}", daemon=True)
        for i in range(config.max_clients)
    ]
    threads.append(threading.Thread(target=probe_loop, name="soak-probe", daemon=True))
    threads.append(threading.Thread(target=rss_loop, name="soak-rss", daemon=True))
    for t in threads:
        t.start()
    while time.monotonic() < deadline:
        time.sleep(min(config.sample_s, max(0.0, deadline - time.monotonic())))
        if time.monotonic() < deadline:
            sample()
    stop.set()
    for t in threads:
        t.join(timeout=config.request_timeout_s)
    # Idle: every page and pull given back (a transfer nobody took is released at its timeout).
    idle_deadline = time.monotonic() + config.idle_timeout_s
    while time.monotonic() < idle_deadline:
        counters = deployment.counters()
        if all(
            c.get("pages_used", 0) == 0 and c.get("pull_threads", 0) == 0 and c.get("transfers_pending", 0) == 0
            for c in counters.values()
        ):
            break
        time.sleep(0.5)
    sample()
    return report(tally, samples, rss_series, before, config)


def report(tally: Tally, samples: list[dict], rss_series: dict, before: dict, config: SoakConfig) -> dict:
    names = sorted({n for s in samples for n in s["processes"]})
    processes = {}
    for name in names:
        series = [(s["t"], s["processes"][name]) for s in samples if s["processes"].get(name)]
        late = [
            (t, p["rss_mb"])
            for t, p in sorted(rss_series.get(name, []) + series, key=lambda x: x[0])
            if config.warmup_s <= t <= config.duration_s
        ]
        times, rss = [t for t, _ in late], [v for _, v in late]
        processes[name] = {
            "rss_mb": [round(p["rss_mb"], 1) for _, p in series],
            "fds": [p["fds"] for _, p in series],
            "threads": [p["threads"] for _, p in series],
            "t": [round(t, 1) for t, _ in series],
            "rss_every_sample": [
                [round(t, 1), round(v, 1)]
                for t, v in sorted((t, p["rss_mb"]) for t, p in rss_series.get(name, []) + series)
            ],
            "rss_fit_after_warmup": fit(times, rss),
            "rss_minima_fit_after_warmup": fit(*minima(times, rss)),
        }
    last = samples[-1]["counters"]
    transfers = {
        k: sum(c.get(k, 0) for c in last.values())
        for k in ("transfers_failed", "transfers_corrupted", "kv_transfers", "transfers_published")
    }
    return {
        "config": dataclasses.asdict(config),
        **tally.summary(),
        "processes": processes,
        "transfers": transfers,
        "idle": last,
        "before": {"counters": before["counters"], "processes": before["processes"]},
    }


def print_report(result: dict, out=print) -> None:
    out(
        f"requests: {result['requests']}; 5xx: {result['5xx']}; stream error events: {result['stream_errors']}; "
        f"client-side failures: {result['client_errors']}; wrong refusals: {result['wrong_refusals']}"
    )
    for key in ("5xx_by_cause", "stream_errors_by_cause", "client_errors_by_cause", "wrong_refusals_by_cause"):
        for why, n in sorted(result[key].items(), key=lambda kv: -kv[1]):
            out(f"  {key.split('_by_')[0]} x{n}: {why}")
    out(
        "by kind: "
        + "; ".join(f"{k} " + ", ".join(f"{o} {n}" for o, n in v.items()) for k, v in result["by_kind"].items())
    )
    out(f"transfers: {result['transfers']}")
    out(
        f"probe: {result['probes']} runs, {len(result['probe_outputs'])} distinct output(s): "
        f"{[o[:60] for o in result['probe_outputs']]}"
    )
    out("RSS fitted after the warm-up, MiB per 10 minutes: every sample, and the lowest of each minute")
    out(
        f"{'process':<12} {'RSS MiB first/last':>19} {'fit (+-stderr, r)':>28} {'minute minima fit':>22} "
        f"{'fds first/last/max':>19} {'threads first/last/max':>23}"
    )
    for name, p in result["processes"].items():
        f, m = p["rss_fit_after_warmup"], p["rss_minima_fit_after_warmup"]
        out(
            f"{name:<12} {p['rss_mb'][0]:>8.0f} /{p['rss_mb'][-1]:>8.0f} "
            f"{f['per_10_min']:>+11.1f} +-{f['stderr_per_10_min']:<5.1f} r={f['r']:+.2f} "
            f"{m['per_10_min']:>+12.1f} +-{m['stderr_per_10_min']:<5.1f} "
            f"{p['fds'][0]:>8}/{p['fds'][-1]}/{max(p['fds'])}{'':>12}{p['threads'][0]}/{p['threads'][-1]}/{max(p['threads'])}"
        )
    out("after the load, idle: " + "; ".join(f"{n} {c}" for n, c in result["idle"].items()))
