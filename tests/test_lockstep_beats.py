"""The group's signs of life (jfire.lockstep), on a real jax.distributed store in a child
process: a leader fails once a follower that had beaten goes silent, never while it beats or
before it has beaten, and a follower's beating thread keeps its counter moving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jfire.deployment_secret import DeploymentSecret, to_env
from jfire.disagg.launch import free_port

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0

SCRIPT = """
import json, sys, time
from jfire import deployment_secret, lockstep
from jfire.disagg import cluster
from jfire.errors import JfireError

store = cluster.join(sys.argv[1], 1, 0, secret=deployment_secret.from_env())
lockstep.FOLLOWER_TIMEOUT_S = float(sys.argv[2])
lockstep.BEAT_S = 0.1
leader = lockstep.StepChannel("g", [0, 1], 0, store)
out = {}

last_beat = None

def beat_for(seconds, follower_beats):
    global last_beat
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if follower_beats:
            store.key_value_increment("jfire/lockstep/g/beat/1", 1)
            last_beat = time.monotonic()
        leader.beat()
        time.sleep(0.1)

# Never heard: not judged, however long.
beat_for(2 * lockstep.FOLLOWER_TIMEOUT_S, False)
out["silent_before_first_beat"] = "ok"
beat_for(2 * lockstep.FOLLOWER_TIMEOUT_S, True)
out["beating"] = "ok"
try:
    beat_for(4 * lockstep.FOLLOWER_TIMEOUT_S, False)
    out["silent"] = None
except JfireError as e:
    out["silent"], out["noticed_after_s"] = str(e), time.monotonic() - last_beat
# A follower's own thread.
follower = lockstep.StepChannel("h", [0, 1], 1, store)
follower.beat_forever()
time.sleep(1.0)
first = store.read_counter("jfire/lockstep/h/beat/1")
time.sleep(1.5)
out["thread_beats"] = store.read_counter("jfire/lockstep/h/beat/1") - first
print(json.dumps(out))
"""


def test_leader_notices_a_silent_follower_and_only_then():
    run = subprocess.run([sys.executable, "-c", SCRIPT, f"127.0.0.1:{free_port()}", str(TIMEOUT_S)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu", **to_env(DeploymentSecret.generate())})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["silent_before_first_beat"] == out["beating"] == "ok"
    assert out["silent"] == f"process 1 of the group stopped: no sign of life for {TIMEOUT_S:g} s"
    # Judged on the leader's own beats (every 0.1 s here): no sooner than the timeout, and soon after.
    assert TIMEOUT_S <= out["noticed_after_s"] < TIMEOUT_S + 1.0
    assert out["thread_beats"] >= 1  # one a second
