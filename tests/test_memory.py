"""jfire.memory: serving processes cap glibc's malloc arenas (a process's threads then share
two, instead of one each) and trim freed memory on a thread of their own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import ctypes, os, sys, tempfile, threading
    from jfire import memory
    if sys.argv[1] == "limit":
        assert memory.limit_malloc_arenas(2)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    barrier = threading.Barrier(8)

    def allocate():  # eight threads allocating at once: glibc hands out arenas as they contend
        barrier.wait()
        for _ in range(2000):
            libc.free(ctypes.c_void_p(libc.malloc(4096)))

    threads = [threading.Thread(target=allocate) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    libc.fopen.restype = ctypes.c_void_p
    path = tempfile.mktemp()
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    print(open(path).read().count("<heap nr="))
    os.unlink(path)
""")


def arenas(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc arenas")
def test_the_cap_keeps_the_threads_to_two_arenas():
    assert arenas("limit") <= 2
    assert arenas("default") > 2  # what the cap prevents: here each contending thread got its own
