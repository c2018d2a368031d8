"""Lines of JAX's and Gloo's own that say nothing wrong and would come on every launch, left
out of what the user sees. C++ writes them straight to file descriptors 1 and 2, out of
Python's reach, so they are dropped where jfire owns the descriptor: `jfire launch` relays its
children's stdout and stderr line by line, and a process joining a group spanning processes
routes its C stdout (where Gloo writes) through a filter to stderr. The list is exact
(docs/logs.md shows each line); anything else, warnings included, goes through unchanged."""

from __future__ import annotations

import os
import re
import threading
from typing import BinaryIO

NOISE = (
    # jax.distributed's coordination service, on every process of a deployment: the
    # deployment asks for recoverable tasks on purpose (jfire/disagg/cluster.py).
    re.compile(
        rb"^[IW]\d{4} [\d:.]+ +\d+ coordination_service\.cc:\d+\] \[\d+\] Using experimental recoverable task "
        rb"feature\. The default shutdown barrier will only block non-recoverable tasks\. If a synchronized "
        rb"shutdown is desired, the user / library should invoke `WaitAtBarrier` explicitly at the end of the "
        rb"program\.$"
    ),
    # Gloo, once per process per collective group it joins (groups spanning processes on CPUs).
    re.compile(
        rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : "
        rb"\d+$"
    ),
)


# Gloo writes its line in pieces; two of its threads writing at once interleave them into one
# line made only of the pieces (its numbers may spill onto the next line or two).
GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|\d+|\s+"
)
SPILLED_NUMBERS = re.compile(rb"[\d\s]*")


def is_noise(line: bytes) -> bool:
    text = line.rstrip(b"\r\n")
    return any(p.match(text) for p in NOISE) or is_gloo_interleaved(text)


def is_gloo_interleaved(text: bytes) -> bool:
    """Several of Gloo's lines written at once, run together: nothing but their pieces."""
    return text.startswith(b"[Gloo] Rank") and b"Expected number" in text and not GLOO_PIECES.sub(b"", text)


def relay(source: BinaryIO, sink: BinaryIO) -> threading.Thread:
    """Copies source to sink line by line, as the lines come, leaving out the noise; returns
    the (daemon) thread doing it, which ends when source closes."""

    def run():
        out: BinaryIO | None = sink
        spilled = 0  # lines after interleaved Gloo pieces that may hold only their numbers
        with source:
            for line in iter(source.readline, b""):
                text = line.rstrip(b"\r\n")
                if spilled and text and SPILLED_NUMBERS.fullmatch(text):
                    spilled -= 1
                    continue
                spilled = 2 if is_gloo_interleaved(text) else 0
                if out is None or is_noise(line):
                    continue
                try:
                    out.write(line)
                    out.flush()
                except (OSError, ValueError):  # the reader went away: keep draining, or the writer blocks
                    out = None

    thread = threading.Thread(target=run, name="jfire-relay", daemon=True)
    thread.start()
    return thread


def stdout_to_stderr_filtered() -> None:
    """From now on what anything in this process writes to file descriptor 1 (Gloo's notes
    included) goes to file descriptor 2, less the noise; Python's sys.stdout keeps the real
    stdout (jfire's own output, which scripts read)."""
    import sys

    sys.stdout.flush()
    kept = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    sys.stdout = os.fdopen(kept, "w", buffering=1)
    relay(os.fdopen(read, "rb"), os.fdopen(os.dup(2), "wb"))
