"""The collector in a serving process (``vlmserve.heap``): off through start-up, then one
collection and a freeze before the models load, so that an unloaded model is freed. Each test
runs in a fresh interpreter: freezing the test process's own heap would leak what the later
tests drop."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def run_python(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_settle_collects_start_ups_garbage_freezes_the_rest_and_resumes_collecting() -> None:
    found = run_python(
        """
        import gc, json, weakref
        from vlmserve import heap

        class Node:
            pass

        heap.pause()
        paused = not gc.isenabled()
        garbage = Node(); garbage.me = garbage  # a cycle: only the collector frees it
        dropped = weakref.ref(garbage); del garbage
        kept = Node(); kept.me = kept
        settled = heap.settle()
        again = heap.settle()
        print(json.dumps({
            "paused": paused, "settled": settled, "again": again,
            "enabled": gc.isenabled(), "garbage_freed": dropped() is None,
            "kept_frozen": not any(o is kept for o in gc.get_objects()),
        }))
        """
    )
    assert found == {
        "paused": True,
        "settled": True,
        "again": False,
        "enabled": True,
        "garbage_freed": True,
        "kept_frozen": True,
    }


def test_settle_does_nothing_in_a_process_that_did_not_pause() -> None:
    found = run_python(
        """
        import gc, json
        from vlmserve import heap
        print(json.dumps({"settled": heap.settle(), "frozen": gc.get_freeze_count()}))
        """
    )
    assert found == {"settled": False, "frozen": 0}


def test_a_model_unloaded_from_a_server_process_is_freed(tiny_dir: Path) -> None:
    # The server's order (cli/serve.py pauses, the app's start-up settles, then loads): a model
    # frozen with start-up's objects would keep whatever of it sits in a reference cycle
    # after it is unloaded.
    found = run_python(
        f"""
        import asyncio, gc, json, weakref
        from pathlib import Path
        from vlmserve import heap
        heap.pause()
        from support import make_settings
        from vlmserve.api.app import build_app

        async def main():
            app = build_app(make_settings(Path({str(tiny_dir)!r})))
            models = app.state.services.models
            async with app.router.lifespan_context(app):
                while models.starting:
                    await asyncio.sleep(0.05)
                handle = models.handles[0]
                model = weakref.ref(handle.backend._loaded.model)
                frozen = gc.get_freeze_count()
                await models.deactivate(handle.name)
                gc.collect()
                return {{"enabled": gc.isenabled(), "frozen": frozen > 100_000,
                         "model_freed": model() is None}}

        print(json.dumps(asyncio.run(main())))
        """
    )
    assert found == {"enabled": True, "frozen": True, "model_freed": True}


def test_an_unloaded_models_weights_and_kv_cache_are_freed_without_waiting_for_the_collector(
    tiny_dir: Path,
) -> None:
    # Automatic collection off: a full pass may come minutes later on a long-lived heap. The
    # unload returns the memory (RAM, or VRAM on a GPU) before it answers, so that the model
    # loaded next in its place finds it free.
    found = run_python(
        f"""
        import asyncio, gc, json, weakref
        from pathlib import Path
        from support import make_settings
        from vlmserve.registry.manager import ModelManager

        async def main():
            models = ModelManager.from_settings(make_settings(Path({str(tiny_dir)!r})))
            await models.load_all()
            gc.disable()
            backend = models.handles[0].backend
            refs = {{"model": weakref.ref(backend._loaded.model),
                     "kv_cache": weakref.ref(backend.engine.runner.cache.k)}}
            await models.deactivate(models.handles[0].name)  # returns once it is freed
            return {{name: r() is None for name, r in refs.items()}}

        print(json.dumps(asyncio.run(main())))
        """
    )
    assert found == {"model": True, "kv_cache": True}
