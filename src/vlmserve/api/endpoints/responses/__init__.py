"""The ``responses`` endpoints."""
