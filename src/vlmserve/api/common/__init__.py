"""Pieces every endpoint that runs the chat model shares: generation, conversion, SSE, keys."""
