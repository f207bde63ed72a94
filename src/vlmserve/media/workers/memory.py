"""Where glibc puts a process's large buffers: their own mappings, or its heap.

glibc serves an allocation of ``M_MMAP_THRESHOLD`` bytes or more from a mapping of its own,
unmapped when freed, and trims free memory off the top of a heap once there is more than
``M_TRIM_THRESHOLD`` of it. Memory handed back this way leaves the RSS at once, and the
next buffer of that size is faulted in again page by page (and zeroed by the kernel).
By default glibc raises both thresholds as large buffers come and go, so a server's RSS
would keep the high-water mark of every media burst; fixed low (128 KiB) they turn every
photo into thousands of page faults: a media worker spent 59% of its time in the kernel
(faults, zeroing, unmapping) at 43 photos/s, 8.6 ms of CPU a 1280x960 photo.

So each process fixes both thresholds for the buffers it handles (``MallocPolicy``):

- the API process (``API``): request bodies, their base64 and parsed JSON up to 1 MiB (a
  photo's data URL) come from the heap and stay mapped for the next request, up to 8 MiB
  free at the top of a heap; anything of 1 MiB or more (a large photo, a video, a decoded
  image on the in-process path) has its own mapping and leaves the RSS when freed, as
  several threads of this process may hold such buffers at once;
- a media worker (``WORKER``): it decodes one item at a time, so what its heap keeps is one
  item's buffers, up to 64 MiB free: a photo's body, its decoded pixels and their copies
  (under 32 MiB each) are not faulted in anew for every image; a larger buffer has its own
  mapping.

Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

__all__ = ["API", "WORKER", "MallocPolicy", "set_malloc_policy"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MiB = 1024 * 1024


@dataclass(frozen=True)
class MallocPolicy:
    mmap_threshold: int  # a buffer this large or larger: its own mapping, unmapped when freed
    trim_threshold: int  # free memory a heap keeps at its top before it gives the rest back


API = MallocPolicy(mmap_threshold=1 * MiB, trim_threshold=8 * MiB)
WORKER = MallocPolicy(mmap_threshold=32 * MiB, trim_threshold=64 * MiB)


def set_malloc_policy(policy: MallocPolicy) -> bool:
    """Fix glibc's thresholds to ``policy`` in this process; whether they were set (glibc on
    Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, policy.mmap_threshold)
            and libc.mallopt(_M_TRIM_THRESHOLD, policy.trim_threshold)
        )
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
