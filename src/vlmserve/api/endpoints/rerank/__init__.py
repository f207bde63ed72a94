"""The ``rerank`` endpoints: ``/v1/rerank`` (Cohere, Jina) and ``/v1/score`` (vLLM)."""
