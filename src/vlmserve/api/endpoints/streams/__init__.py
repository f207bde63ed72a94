"""The ``streams`` endpoints."""
