"""Freed heap pages back to the system after a burst of large answers: glibc's ``malloc_trim``.

Beside an engine the sidecar holds answers of megabytes (DeepSeek-V3's routing for 2,000 tokens is
1.3 MB of base64 in vLLM's format), up to ``--count-queue-bytes`` of them while they wait to be
counted. glibc serves a block that large with an ``mmap`` of its own at first; on the first such
free it raises its threshold to that size (up to 32 MiB on 64-bit), and from then on the blocks come
from the heap, whose freed pages it keeps for reuse: a burst that filled the count queue left the
server hundreds of MiB resident after the queue drained (bench/heap.py). ``malloc_trim(0)`` hands
the free pages back. Fixing the threshold instead (what ``MALLOC_MMAP_THRESHOLD_`` does) kept
memory as low but made every answer slower: each of its large blocks is then fresh pages.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

__all__ = ["release_free_memory"]


def _malloc_trim() -> Callable[[int], int] | None:
    try:  # "glibc 2.36"; musl and macOS have no such name, Windows no confstr
        libc = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not libc or not libc.startswith("glibc"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system (glibc); True where any were returned.

    A no-op returning False where the C library is not glibc. Blocks the calling thread for as long
    as glibc walks its heap (milliseconds for hundreds of MiB), and ctypes lets other threads run
    meanwhile: call it off the event loop.
    """
    return _TRIM is not None and bool(_TRIM(0))
