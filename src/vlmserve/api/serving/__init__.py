"""Serving logic behind the routers."""
