"""Give large freed buffers back to the operating system at once (glibc).

A 20 MB base64 body, its parsed text and its decoded pixels are freed within a second, but
glibc raises its mmap threshold after the first such free and serves the next ones from its
heaps, which it rarely trims: a server's RSS then keeps the high-water mark of every media
burst. A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``) keeps buffers of 128 KiB and more in
their own mappings, unmapped on free. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["return_large_buffers"]

_M_MMAP_THRESHOLD = -3
THRESHOLD = 128 * 1024  # glibc's own starting value, kept fixed


def return_large_buffers(threshold: int = THRESHOLD) -> bool:
    """Whether the threshold was set (glibc on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
