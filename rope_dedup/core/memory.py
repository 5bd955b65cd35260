"""Hand memory that sharing freed back to the operating system.

A freed CPU table of a few MB sits below glibc's mmap threshold, so it lives in the malloc heap, and
glibc keeps freed heap memory in the process: RSS hardly moves although the copies are gone (measured:
126 layers x 2 MB tables, 528 MB -> 4.2 MB of RoPE storage, RSS only 42 MB lower). ``malloc_trim(0)``
returns those pages (about 500 MB there, for 75 ms once). It is called after a compile that freed
tables, and from run-time interning only once enough has been freed since the last call, never on the
per-call path. CUDA needs nothing: torch's caching allocator keeps freed blocks for its own reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time

log = logging.getLogger("rope_dedup")

# Run-time interning frees one block's tables at a time: trim once this much has piled up, so that a
# 126-block model trims a handful of times, not once per block.
TRIM_THRESHOLD_BYTES = 64 << 20


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has no such function (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return freed heap memory to the OS where the C library can; whether it could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    started = time.perf_counter()
    trim(0)
    log.debug("rope_dedup: malloc_trim(0) took %.1f ms", (time.perf_counter() - started) * 1e3)
    return True


def release_if_freed(store, at_least: int = 1) -> bool:
    """Trim once ``store``'s aliasing has let go of at least ``at_least`` CPU bytes since the last trim."""
    if store.freed_cpu_bytes < at_least:
        return False
    store.take_freed_cpu_bytes()
    return release_freed_memory()
