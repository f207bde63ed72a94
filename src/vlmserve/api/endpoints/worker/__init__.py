"""The ``worker`` endpoints."""
