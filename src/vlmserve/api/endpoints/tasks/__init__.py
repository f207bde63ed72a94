"""The ``tasks`` endpoints."""
