"""The ``tokenize`` endpoints."""
