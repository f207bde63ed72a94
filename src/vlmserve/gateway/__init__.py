"""The gateway: everything a proxied model (``openai`` and ``vllm`` registry entries) needs.

- ``upstream.py``: the ``openai`` backend (replicas, prepare/generate over the upstream's SSE,
  relay of worker endpoints, embeddings); ``upstream_passthrough.py`` its pass-through side
  (streams passed as bytes to vlmserve workers);
- ``upstream_wire.py``: the OpenAI wire as the proxy sees it (request body, SSE reader, errors);
- ``upstream_http.py``: the upstream HTTP client; ``upstream_lean.py``: the hot-path HTTP/1.1
  client for chat to plain-``http`` replicas;
- ``vllm.py``: the ``vllm`` backend, a ``vllm serve`` subprocess under ``supervisor.py``;
- ``passthrough.py``: the ASGI middleware that passes streamed chat through as bytes;
  ``passthrough_relay.py`` its byte relay; ``passed.py`` where passed streams live;
- ``pool.py``: a model's replica pool (least outstanding, health, ejection, admission);
- ``registration_worker.py``: the worker's side (register on start, deregister on stop);
  ``registration_gateway.py``: the gateway's side (workers join and leave the pools).
"""
