"""Start each measurement on an idle machine.

A server can keep the CPUs busy after its load ends: vLLM's CPU build busy-polls in its
engine core and spins its OpenMP threads for about a second (measured here: ~0.86 core-seconds
after a c=8 run of 16 requests, against none for vlmserve, whose engine thread returns when
idle). Measured right after it, the next server would run its first second on half the CPUs
of a 2-core machine: a bias against whoever follows a busy-polling server in the rotation.
``wait_idle`` waits until the whole machine is idle before the next measurement starts.
"""

from __future__ import annotations

import time

import psutil

__all__ = ["wait_idle"]


def wait_idle(timeout: float, *, busy_percent: float = 10.0, window: float = 0.25) -> float:
    """Block until the machine's CPUs were busy less than ``busy_percent`` (all CPUs
    together) over one ``window`` of seconds, or ``timeout`` seconds passed.
    -> the seconds waited (0 when ``timeout`` <= 0: no wait)."""
    if timeout <= 0:
        return 0.0
    began = time.monotonic()
    while psutil.cpu_percent(interval=window) >= busy_percent:
        if time.monotonic() - began >= timeout:
            break
    return time.monotonic() - began
