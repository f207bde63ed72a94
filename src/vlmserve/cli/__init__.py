"""The ``vlmserve`` command line (typer)."""
