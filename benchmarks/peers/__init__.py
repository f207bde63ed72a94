"""Peer servers for benchmarks/serve.py: install scripts, launch specs, result tables."""
