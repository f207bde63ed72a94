"""The batched engine, model-agnostic (design: docs/engine.md).

``BatchEngine`` (engine.py) runs the step loop; ``Scheduler`` admits requests by free KV
blocks (``BlockManager``) and preempts; the model runner (``engine.models``) does prefill
and decode forwards over a ``PagedKVCache`` under a byte budget; ``Sampler`` picks tokens
for all rows at once. The model code (runners, rotary tables, vision, one adapter per
family) lives in ``engine.models``.
"""
