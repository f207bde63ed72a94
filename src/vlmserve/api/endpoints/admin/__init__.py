"""The ``admin`` endpoints."""
