"""What this process's allocator does with large buffers: how many pages the kernel faults in
to hand it buffers it has had before, and how much of a freed burst leaves its RSS."""

from __future__ import annotations

import resource
import threading

__all__ = ["page_faults", "rss_given_back"]


def page_faults(size: int, count: int = 5, rounds: int = 20, thread: bool = False) -> float:
    """Minor page faults per round of making ``count`` zeroed buffers of ``size`` bytes and
    freeing them, a small object kept after each round (as a server's requests leave some),
    after two such rounds to warm up; on a thread of its own (its own malloc arena) with
    ``thread``."""
    if thread:
        out: list[float] = []
        worker = threading.Thread(target=lambda: out.append(page_faults(size, count, rounds)))
        worker.start()
        worker.join()
        return out[0]

    def one_round() -> None:
        buffers = [bytearray(size) for _ in range(count)]
        kept.append(bytes(100))
        del buffers

    kept: list[bytes] = []
    one_round()
    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        one_round()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds


KEPT = 200_000  # too large for the free bits of a heap: made after the buffer before it


def _rss() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def rss_given_back(size: int, count: int = 16) -> float:
    """The share of ``count`` zeroed buffers of ``size`` bytes that leaves the RSS when they
    are freed, each made with a smaller object after it that stays (as a server's requests
    leave objects between their buffers): a buffer in a heap is then not at its top, where
    freed memory is trimmed, and leaves the RSS only if it had a mapping of its own."""
    kept: list[bytes] = []
    buffers: list[bytearray] = []
    for _ in range(count):
        buffers.append(bytearray(size))
        kept.append(bytes(KEPT))
    before = _rss()
    del buffers
    return (before - _rss()) / (size * count)
