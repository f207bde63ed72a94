"""The ``gateway`` endpoints."""
