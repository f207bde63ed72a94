"""A model's engine in its own process (``engine_process``, the default): ``client.py`` in the API
process, ``core.py`` in the engine process, ``wire.py`` between them."""

from vlmserve.engine.proc.client import EngineProcClient

__all__ = ["EngineProcClient"]
