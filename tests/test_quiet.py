"""The noise jfire.quiet drops is exactly what docs/logs.md lists: those lines go, any other
line (an unlisted warning of the same libraries included) comes through, in order."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from jfire import quiet

DOCS = Path(__file__).resolve().parents[1] / "docs" / "logs.md"

# Lines as the libraries write them, and lines that look alike but are not on the list.
NOISE = [
    "W1205 23:27:22.398434   14176 coordination_service.cc:185] [5189285529122039169] Using experimental "
    "recoverable task feature. The default shutdown barrier will only block non-recoverable tasks. If a "
    "synchronized shutdown is desired, the user / library should invoke `WaitAtBarrier` explicitly at the end of "
    "the program.",
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "[Gloo] Rank 3 is connected to 11 peer ranks. Expected number of connected peer ranks is : 11",
]
KEPT = [
    "W1205 23:27:22.398434   14176 coordination_service.cc:412] [5189285529122039169] Task /job:jax_worker/"
    "replica:0/task:2 heartbeat timeout",
    "E1205 23:27:22.398434   14176 coordination_service.cc:185] Using experimental recoverable task feature. And "
    "something went wrong.",
    "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1, timed out",
    "jfire: launch: process 1 prefill-0/0 (1 devices): pid 2959",
    "UserWarning: an unlisted warning",
]


def test_exactly_the_listed_lines_are_noise():
    assert all(quiet.is_noise(line.encode()) for line in NOISE)
    assert not any(quiet.is_noise(line.encode()) for line in KEPT)


def test_the_docs_show_every_pattern_a_line_of_each():
    documented = re.findall(r"^ *```text\n *(.+)\n *```$", DOCS.read_text(), re.M)
    assert len(quiet.NOISE) == len(documented)
    for pattern, line in zip(quiet.NOISE, documented):
        assert pattern.match(line.encode()), line


def test_a_child_process_relayed_loses_the_noise_and_nothing_else():
    """As `jfire launch` relays its processes: the child writes to its file descriptor 2
    directly, as C++ does."""
    lines = [NOISE[0], KEPT[0], NOISE[1], KEPT[4], NOISE[2], KEPT[2]]
    code = f"import os\nfor line in {lines!r}:\n    os.write(2, (line + '\\n').encode())\n"
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as sink:
        quiet.relay(child.stderr, sink).join(30)
    child.wait(30)
    with os.fdopen(read_end, "rb") as got:
        assert got.read().decode().splitlines() == [KEPT[0], KEPT[4], KEPT[2]]


def test_gloo_lines_written_at_once_and_run_together_are_noise_too():
    """Two of Gloo's threads wrote their lines into one (seen in a launch's log), the numbers
    one lost coming on the next line; a line that only starts alike still comes through."""
    together = ("[Gloo] Rank [Gloo] Rank 1 is connected to 30 peer ranks.  is connected to Expected number of "
                "connected peer ranks is : 33 peer ranks. Expected number of connected peer ranks is : ")
    lines = [KEPT[0], together, "3330", KEPT[2], "42", KEPT[4]]
    code = f"import os\nfor line in {lines!r}:\n    os.write(2, (line + '\\n').encode())\n"
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as sink:
        quiet.relay(child.stderr, sink).join(30)
    child.wait(30)
    with os.fdopen(read_end, "rb") as got:
        assert got.read().decode().splitlines() == [KEPT[0], KEPT[2], "42", KEPT[4]]


def test_a_group_process_stdout_goes_to_stderr_less_the_noise():
    """What a process joining a group spanning processes does before Gloo starts: fd 1
    (Gloo's) goes to stderr, filtered; Python's stdout stays jfire's output."""
    code = textwrap.dedent(f"""
        import os, time
        from jfire import quiet
        quiet.stdout_to_stderr_filtered()
        os.write(1, {(NOISE[1] + chr(10) + KEPT[3] + chr(10)).encode()!r})
        print("jfire's own output")
        time.sleep(0.5)  # the relay thread writes as the lines come
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "jfire's own output\n"
    assert run.stderr.splitlines() == [KEPT[3]]


def test_a_relay_whose_reader_left_keeps_draining_so_the_child_never_blocks():
    """`jfire launch ... | head`: once the reader is gone the relay drops lines instead of
    stopping, so the processes writing to it are never stuck on a full pipe."""
    code = "import os\nfor i in range(20000):\n    os.write(2, b'x' * 100 + b'\\n')\n"
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads what is relayed
    with os.fdopen(write_end, "wb", buffering=0) as sink:
        relay = quiet.relay(child.stderr, sink)
        assert child.wait(60) == 0  # 2 MB: far more than a pipe holds
        relay.join(30)
        assert not relay.is_alive()
