"""In-process backend on transformers + torch (+ peft for adapters)."""
