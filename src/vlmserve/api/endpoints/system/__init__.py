"""The ``system`` endpoints."""
