"""Text fields that must be valid Unicode.

JSON can carry lone UTF-16 surrogates (``"\\ud800"``); Python decodes them into a ``str``
that no tokenizer can encode, so they are refused at the wire with a 4xx naming the field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

__all__ = ["UnicodeText", "valid_unicode"]


def valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text holds an unpaired UTF-16 surrogate at character {exc.start}; send valid "
            "Unicode (pair surrogates, or drop the character)"
        ) from None
    return value


UnicodeText = Annotated[str, AfterValidator(valid_unicode)]
