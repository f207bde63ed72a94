"""Thin routers: parse, call the serving layer, pick JSON or SSE."""
