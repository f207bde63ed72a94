"""The ``embeddings`` endpoints."""
