"""vlmserve: an OpenAI-compatible inference server for vision-language models."""

__version__ = "0.1.0"
