"""How many pages the kernel faults in to hand this process buffers it has had before."""

from __future__ import annotations

import resource
import threading

__all__ = ["page_faults"]


def page_faults(size: int, count: int = 5, rounds: int = 20, thread: bool = False) -> float:
    """Minor page faults per round of making ``count`` zeroed buffers of ``size`` bytes (a
    small object made between them, as a server's requests do) and freeing them, after two
    such rounds to warm up; on a thread of its own (its own malloc arena) with ``thread``."""
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
