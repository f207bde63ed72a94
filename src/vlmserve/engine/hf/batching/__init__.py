"""Continuous batching for the VLM families of ``families/`` in the ``hf`` engine (design:
docs/engine.md).

``BatchEngine`` (engine.py) runs the step loop; ``Scheduler`` admits requests by free KV
blocks (``BlockManager``) and preempts; the runner (runner.py) does prefill and decode
forwards over a ``PagedKVCache`` under a byte budget; ``Sampler`` picks
tokens for all rows at once; ``PromptEmbedder`` + ``VisionCache`` turn images and videos
into prompt embeddings, skipping the vision tower for content it has seen.
"""

from vlmserve.engine.hf.batching.architectures import supports
from vlmserve.engine.hf.batching.engine import END, BatchEngine
from vlmserve.engine.hf.batching.faults import EngineFailed, OutOfMemory, RequestFailed
from vlmserve.engine.hf.batching.vision_cache import VisionCache

__all__ = [
    "END",
    "BatchEngine",
    "EngineFailed",
    "OutOfMemory",
    "RequestFailed",
    "VisionCache",
    "supports",
]
