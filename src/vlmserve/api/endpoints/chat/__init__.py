"""The ``chat`` endpoints."""
