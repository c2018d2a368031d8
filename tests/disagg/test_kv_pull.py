"""Pulls of KV transfers between two real processes, as the decode side runs them
(kv_transfer.Puller): many transfers published at once and pulled concurrently each arrive
byte for byte as sent, and the pull threads stay a fixed few however many transfers pass.

With jaxlib 0.10.2, a pull whose connection closes as soon as pull() returns (before the data
has arrived) lets another pull's bytes overwrite the tail of its arrays in flight: this test,
run against a Pull that dropped its connection that way, found over a quarter of its arrays
wrong (scripts/repro_transfer_teardown.py shows the same with jaxlib alone)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import transfer

from jfire.disagg.kv_transfer import Puller

TRANSFERS = 96  # published by the sender, each ARRAYS arrays of VALUES int32 values (1 MiB)
ARRAYS = 4
VALUES = 1 << 18
CONCURRENT = 8  # pulls at once (the decode side's default is kv_transfer.PULL_WORKERS)

SENDER = textwrap.dedent(f"""
    import sys
    import jax, jax.numpy as jnp
    from jax.experimental import transfer
    server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    make = jax.jit(lambda u: [jnp.arange({VALUES}, dtype=jnp.int32) * 7 + u * 1000 + k for k in range({ARRAYS})])
    kept = []  # a sender keeps what it published alive, as the prefill side does until acknowledged
    for u in range({TRANSFERS}):
        arrays = make(u)
        server.await_pull(u, arrays)
        kept.append(arrays)
    print(server.address(), flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


def expected(uuid: int, k: int) -> np.ndarray:
    return np.arange(VALUES, dtype=np.int32) * 7 + uuid * 1000 + k


@pytest.fixture(scope="module")
def sender():
    process = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    address = process.stdout.readline().strip()
    assert address, "the sender did not start"
    yield address
    process.stdin.close()
    process.wait(timeout=30)


def pull_threads() -> int:
    return sum(t.name.startswith("jfire-pull-") for t in threading.enumerate())


def test_concurrent_pulls_arrive_intact_on_a_fixed_pool_of_threads(sender):
    server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    device = jax.local_devices()[0]
    structs = [jax.ShapeDtypeStruct((VALUES,), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))
               for _ in range(ARRAYS)]
    threads_before = pull_threads()
    puller = Puller(server, workers=CONCURRENT)
    assert pull_threads() == threads_before + CONCURRENT

    pulls = {u: puller.pull(sender, u, structs, timeout_s=120) for u in range(TRANSFERS)}
    assert pull_threads() == threads_before + CONCURRENT  # queued, not a thread each
    deadline = time.monotonic() + 120
    while not all(p.done for p in pulls.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(p.done for p in pulls.values()), "pulls did not finish"
    assert [u for u, p in pulls.items() if p.error] == []

    wrong = [(u, k) for u, p in pulls.items() for k, a in enumerate(p.arrays)
             if not np.array_equal(np.asarray(a), expected(u, k))]
    assert wrong == [], f"{len(wrong)} of {TRANSFERS * ARRAYS} arrays arrived with other bytes: {wrong[:8]}"
    assert puller.in_flight == 0
    puller.shutdown()
    deadline = time.monotonic() + 10
    while pull_threads() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pull_threads() == threads_before
