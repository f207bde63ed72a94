"""The cyclic garbage collector in a serving process (the API process, an engine process).

Start-up makes close to a million objects, most of which live as long as the process: the
modules, classes and functions of torch, transformers, FastAPI and ours. CPython walks every
object in a full collection, and starts one whenever the heap has grown by a quarter since
the last; start-up thus paid for several walks of its growing heap (2.0 s of a 13 s start
on a 2-core AVX2 machine, 1.7 s in an engine process), and once serving, each full
collection that requests' objects set off walked it all again, holding the event loop or a
decode step meanwhile (~0.1-0.7 s).

So a serving process pauses the collector from its start (``pause``); once its code is
imported it collects once (start-up's cyclic garbage: about a third of what was made) and
freezes what is left out of the collector's reach (``settle``), then collects as usual.

Where the models are unloaded while the process goes on (the API process: deactivate, idle
unload, a reload after a failure) they are loaded after ``settle`` and stay within reach: the
engine frees a model by reference counting, but whatever of it sits in a reference cycle (a
kernel library's ctypes objects, say) only a collection frees, and frozen, never. An engine
process serves one model until it exits, so it settles after loading, freezing the model too.

In a process that did not ``pause`` (tests that build the app in-process, a Ray replica's
host) ``settle`` does nothing: the collector there is whoever owns the process's.
"""

from __future__ import annotations

import gc

__all__ = ["pause", "settle"]

_paused = False


def pause() -> None:
    """The collector off until ``settle``: call it first thing in a serving process."""
    global _paused
    gc.disable()
    _paused = True


def settle() -> bool:
    """After ``pause``: one full collection, everything left frozen, the collector back on.
    Returns whether it did so (False without a ``pause``, or when already settled)."""
    global _paused
    if not _paused:
        return False
    gc.collect()
    gc.freeze()
    gc.enable()
    _paused = False
    return True
