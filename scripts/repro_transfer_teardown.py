"""jaxlib alone: a transfer-server pull whose connection closes before its data has arrived
can receive another pull's bytes.

    .venv/bin/python scripts/repro_transfer_teardown.py [--transfers 96] [--concurrent 8]

A sender process publishes --transfers lists of 4 int32 arrays (1 MiB each, every value known)
with `await_pull`; this process pulls them, --concurrent at a time, two ways:
  dropped: `server.connect(address).pull(uuid, structs)`, then `block_until_ready` (the
           connection object is gone as soon as pull() returns, before the data has arrived);
  held:    the connection kept until `block_until_ready` has returned.
It prints how many arrays arrived with bytes other than those sent, for each. Measured with
jax/jaxlib 0.10.2 on CPU: dropped 111-175 of 384 arrays wrong, held 0.

Why (read from xla/python/transfer at the commit jaxlib 0.10.2 was built from): the receiver's
connection going away half-closes the socket connection; the sender's send handler then runs
`table_.ClearAll()`, which hands every staging buffer of that connection back to the server's
shared pool, although zero-copy sends (`MSG_ZEROCOPY`) from them may still be queued in the
kernel (on loopback they are copied only when sent). The next pull's copy into the same
staging slot then changes the bytes still to be sent, so the receiver gets the tail of
another transfer. jfire holds every connection until its pull's arrays are ready
(jfire.disagg.kv_transfer.fetch)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading

ARRAYS, VALUES = 4, 1 << 18


def sender(transfers: int) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer

    server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    make = jax.jit(lambda u: [jnp.arange(VALUES, dtype=jnp.int32) * 7 + u * 1000 + k for k in range(ARRAYS)])
    kept = []
    for round_ in range(2):  # one set of uuids per way of pulling
        for u in range(transfers):
            arrays = make(round_ * transfers + u)
            server.await_pull(round_ * transfers + u, arrays)
            kept.append(arrays)
    print(server.address(), flush=True)
    sys.stdin.read()


def receive(address: str, first: int, transfers: int, concurrent: int, hold: bool) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import transfer

    server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    structs = [jax.ShapeDtypeStruct((VALUES,), jnp.int32, sharding=sharding) for _ in range(ARRAYS)]
    slots, lock, wrong = threading.Semaphore(concurrent), threading.Lock(), []

    def pull(u: int) -> None:
        try:
            if hold:
                connection = server.connect(address)
                arrays = connection.pull(u, structs)
                jax.block_until_ready(arrays)
                del connection
            else:
                arrays = server.connect(address).pull(u, structs)
                jax.block_until_ready(arrays)
            for k, a in enumerate(arrays):
                if not np.array_equal(np.asarray(a), np.arange(VALUES, dtype=np.int32) * 7 + u * 1000 + k):
                    with lock:
                        wrong.append((u, k))
        finally:
            slots.release()

    threads = []
    for u in range(first, first + transfers):
        slots.acquire()
        threads.append(threading.Thread(target=pull, args=(u,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return len(wrong)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transfers", type=int, default=96)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--sender", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        return sender(args.transfers)
    process = subprocess.Popen([sys.executable, __file__, "--sender", "--transfers", str(args.transfers)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = process.stdout.readline().strip()
    try:
        total = args.transfers * ARRAYS
        dropped = receive(address, 0, args.transfers, args.concurrent, hold=False)
        held = receive(address, args.transfers, args.transfers, args.concurrent, hold=True)
        print(f"connection dropped when pull() returns: {dropped} of {total} arrays arrived with other bytes")
        print(f"connection held until the arrays are ready: {held} of {total} arrays arrived with other bytes")
    finally:
        process.stdin.close()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
