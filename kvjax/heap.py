"""Handing freed heap memory back to the operating system.

glibc's allocator keeps what a process frees in its arenas, and after a large block is freed
it raises its mmap threshold (up to 32 MiB), so the next arrays of a few MiB come from the
arenas too. A one-off operation that copies a whole cache through the heap (a snapshot saved
or restored: ~0.5 GB for a small model with host and disk tiers) then leaves its copies'
pages resident after they are freed, and each later one adds to them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def release_free_heap() -> bool:
    """Returns the free pages of every malloc arena to the system (glibc's ``malloc_trim(0)``;
    a few milliseconds). Live memory is untouched. Returns whether any was released; False
    where the C library has no ``malloc_trim`` (musl, macOS)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
