"""The ``batches`` endpoints."""
