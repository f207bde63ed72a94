"""One folder per endpoint family: ``router.py`` (thin: parse, call, pick JSON or SSE),
``protocol.py`` (pydantic wire models, OpenAI's shapes) and ``service.py`` (the work)."""
