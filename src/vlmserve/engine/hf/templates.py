"""``--chat-template``: a model's chat template replaced by one the operator gives.

LLaVA-1.5 needs it ( checkpoints without a template, or with
one that drops images). The value is a file path or the Jinja text itself; it is read when the
server starts and checked when the model loads, by rendering a one-image conversation, so a
broken template fails start-up instead of the first request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.errors import ConfigError

__all__ = ["install_chat_template", "read_chat_template"]

_PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]


def read_chat_template(value: str) -> str:
    """The template text of ``--chat-template`` (a file, else the Jinja text itself)."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"chat template {value!r} is neither a file nor a Jinja template; give the path "
            "of a .jinja file or the template text (it contains {{ or {%)"
        )
    text = path.read_text(encoding="utf-8")
    if "{{" not in text and "{%" not in text:
        raise ConfigError(f"chat template file {path} holds no Jinja template")
    return text


def install_chat_template(processor: Any, template: str, model: str) -> None:
    """Use ``template`` for ``processor`` (and its tokenizer); ConfigError if it cannot
    render a simple conversation with an image."""
    processor.chat_template = template
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.chat_template = template
    try:
        text = processor.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja's errors have no common base: any failure is the template's
        raise ConfigError(
            f"the chat template given for {model!r} does not render a simple conversation: {exc}"
        ) from exc
    if "Hi" not in text:
        raise ConfigError(f"the chat template given for {model!r} drops the user's text")
