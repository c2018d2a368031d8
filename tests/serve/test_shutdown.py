"""SIGTERM drains a real `jfire serve`: new requests get 503 and /health says draining, a request
that finishes within the grace period streams to its end, one that cannot is ended with an error
event and [DONE], and the process exits 0 after shutting its engine down. (Before, streams were
cut mid-body with neither, and the process exited 143.)"""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.limits import SERVE_LIMITS
from tests.serve.server_process import start_server

GRACE_S = 8
SERVER_ARGS = [*SERVE_LIMITS, "--shutdown-grace", str(GRACE_S), "--no-access-log"]


def stream(url: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = {"model": "default", "prompt": "Tell me about the sea.", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_sigterm_drains_then_exits_cleanly(default_checkpoint, tmp_path):
    server = start_server(SERVER_ARGS, tmp_path / "server.log")
    try:
        # 12 tokens take well under a second; 400 take over 20 s on this machine, far past the grace.
        short, long = [], []
        short_started, long_started = threading.Event(), threading.Event()
        threads = [threading.Thread(target=stream, args=(server.url, 400, long, long_started)),
                   threading.Thread(target=stream, args=(server.url, 12, short, short_started))]
        threads[0].start()
        assert long_started.wait(120)
        threads[1].start()
        assert short_started.wait(120)
        server.process.send_signal(signal.SIGTERM)
        late = httpx.post(server.url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                          timeout=30)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        for t in threads:
            t.join(GRACE_S + 60)
        code = server.process.wait(timeout=60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert code == 0, server.log.read_text()[-3000:]
    assert "jfire: access:" not in server.log.read_text()  # --no-access-log
    # The short request ran to its end...
    assert short[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in short[:-1]]
    assert finish[-1] == "length"
    # ... the long one was ended with an error event, then [DONE].
    assert long[-1] == "[DONE]" and "shutting down" in json.loads(long[-2])["error"]["message"]
    assert len(long) < 400
