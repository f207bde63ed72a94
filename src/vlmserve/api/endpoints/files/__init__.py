"""The ``files`` endpoints."""
