"""Giving a serving process's freed host memory back to the system, every few seconds.

On the CPU backend every device buffer (KV pages gathered or pulled for a transfer, program
outputs and temporaries) is host memory from glibc's malloc. Freed memory inside malloc's heaps
is kept for reuse, and once a block of a given size has been freed glibc serves that size from
its heaps rather than from mappings of its own; so a server's RSS climbs, over many minutes, to
the rarest peak of buffers it ever had in flight at once, and stays there (in 12-minute soaks,
+35 to +130 MiB per 10 minutes after the warm-up; docs/disaggregation.md). `malloc_trim(0)`
hands every whole free page of every heap back. Measured on the default model at batch 16,
every 5 s: the same throughput (10.2 s for 16 requests either way), 80-200 MiB less RSS, 2-6 ms
a trim on its own thread. Fixing glibc's mmap threshold instead (every buffer of 256 KiB or more
mapped and unmapped on its own) cost 20% of that throughput in page faults.

glibc also gives each thread that allocates concurrently an arena of its own, up to eight per
core, and a freed block goes back to the arena it came from: buffers allocated on the pull
threads and freed on the engine thread leave free space scattered over 16 arenas that no trim
can return while anything is allocated above it (a decode group measured with malloc_info:
in use flat at about 180 MiB, arenas' free space 204 -> 477 MiB in 9 minutes; the Python heap
flat). Two arenas bound that: in a 12-minute soak of local-1p1d the decode group ended 275 MiB
smaller (1993 against 2268 MiB) and its RSS fit went from +51 to -43 MiB per 10 minutes, at the
same throughput (427 requests against 403).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

TRIM_EVERY_S = 10.0
TRIM_THREAD = "jfire-malloc-trim"


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


M_ARENA_MAX = -8  # glibc's mallopt parameter
SERVING_ARENAS = 2


def limit_malloc_arenas(arenas: int = SERVING_ARENAS) -> bool:
    """Caps glibc's malloc arenas for the rest of the process (as MALLOC_ARENA_MAX does); call
    it before the threads that allocate start. False where there is no glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, arenas))


def trim_freed_memory_periodically(every_s: float = TRIM_EVERY_S) -> bool:
    """Starts a daemon thread that calls glibc's malloc_trim(0) every `every_s` seconds for
    the rest of the process (once per process); False where there is no glibc."""
    libc = _glibc()
    if libc is None:
        return False
    if any(t.name == TRIM_THREAD for t in threading.enumerate()):
        return True
    stop = threading.Event()  # never set: the thread lives as long as the process

    def trim() -> None:
        while not stop.wait(every_s):
            libc.malloc_trim(0)

    threading.Thread(target=trim, name=TRIM_THREAD, daemon=True).start()
    return True
