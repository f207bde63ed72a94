"""``/v1/rerank`` (Cohere v1/v2 and Jina shapes, as vLLM serves them) and ``/v1/score``
(vLLM's), with images and video as documents.

An *item* (a query, a document, one side of a score pair) is one of:

- a string: text (Cohere, Jina, vLLM);
- an object ``{"text", "image", "video", "file_id"}`` (Jina's ``{"image": url}`` and
  Cohere v1's ``{"text": ...}``; text may go with one image or video): ``image`` and
  ``video`` are http(s) or data URLs (or base64), ``file_id`` an uploaded file (image or
  video, told apart by its bytes);
- vLLM's multimodal form ``{"content": [parts]}`` with ``text``, ``image_url`` and
  ``video_url`` parts: as a query, its parts make one item; as ``documents`` (or a score
  side), each part is one document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from vlmserve.api.common.text import UnicodeText
from vlmserve.api.endpoints.chat.protocol import UrlRef

__all__ = [
    "ItemIn",
    "MultiModalIn",
    "RerankRequest",
    "ScoreRequest",
    "WireItem",
]

_Url = Annotated[str, Field(min_length=1)]


class ItemIn(BaseModel):
    """A document or query as an object (Jina, Cohere v1)."""

    model_config = ConfigDict(extra="ignore")

    text: UnicodeText | None = None
    image: _Url | None = None
    video: _Url | None = None
    file_id: str | None = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _one_media(self) -> ItemIn:
        media = [m for m in (self.image, self.video, self.file_id) if m is not None]
        if len(media) > 1:
            raise ValueError("an item holds at most one of image, video or file_id")
        if not media and self.text is None:
            raise ValueError("an item needs text, an image, a video or a file_id")
        return self


class _TextPart(BaseModel):
    type: Literal["text"]
    text: UnicodeText


class _ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: str | UrlRef


class _VideoPart(BaseModel):
    type: Literal["video_url"]
    video_url: str | UrlRef


_PartIn = Annotated[_TextPart | _ImagePart | _VideoPart, Field(discriminator="type")]


class MultiModalIn(BaseModel):
    """vLLM's ``ScoreMultiModalParam``: ``{"content": [parts]}``."""

    model_config = ConfigDict(extra="ignore")

    content: list[_PartIn]

    def items(self) -> list[ItemIn]:
        """One item per part (documents, a score side)."""
        return [_part_item(p) for p in self.content]

    def joined(self) -> ItemIn:
        """All parts as one item (a query): its text, and at most one image or video."""
        items = self.items()
        text = " ".join(i.text for i in items if i.text) or None
        media = [i for i in items if i.text is None]
        if len(media) > 1:
            raise ValueError("a multimodal query holds at most one image or video")
        first = media[0] if media else ItemIn(text=text)
        return ItemIn(text=text, image=first.image, video=first.video)


def _url(value: str | UrlRef) -> str:
    return value if isinstance(value, str) else value.url


def _part_item(part: _TextPart | _ImagePart | _VideoPart) -> ItemIn:
    if isinstance(part, _TextPart):
        return ItemIn(text=part.text)
    if isinstance(part, _ImagePart):
        return ItemIn(image=_url(part.image_url))
    return ItemIn(video=_url(part.video_url))


def _text_item(value: Any) -> Any:
    return {"text": value} if isinstance(value, str) else value


# A string is the item ``{"text": ...}``: one model, so a bad item gets ItemIn's own message.
WireItem = Annotated[ItemIn, BeforeValidator(_text_item)]
_Many = list[WireItem] | MultiModalIn


def as_items(value: ItemIn | _Many) -> list[ItemIn]:
    """A side of the request as items, in order."""
    if isinstance(value, MultiModalIn):
        return value.items()
    return list(value) if isinstance(value, list) else [value]


class RerankRequest(BaseModel):
    """Cohere's ``/v1/rerank`` and ``/v2/rerank`` and Jina's, as vLLM reads them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, min_length=1, max_length=512)
    query: WireItem | MultiModalIn
    documents: _Many
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    max_tokens_per_doc: int | None = Field(default=None, ge=1)  # Cohere v2: cut longer text

    def query_item(self) -> ItemIn:
        if isinstance(self.query, MultiModalIn):
            return self.query.joined()
        return self.query


class ScoreRequest(BaseModel):
    """vLLM's ``/v1/score``: ``text_1``/``text_2`` or ``data_1``/``data_2``; one side a single
    item (one-to-many) or both lists of one length (pairwise)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, min_length=1, max_length=512)
    text_1: WireItem | _Many | None = None
    text_2: WireItem | _Many | None = None
    data_1: WireItem | _Many | None = None
    data_2: WireItem | _Many | None = None
    max_tokens_per_doc: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_form(self) -> ScoreRequest:
        text = self.text_1 is not None or self.text_2 is not None
        data = self.data_1 is not None or self.data_2 is not None
        if text == data:
            raise ValueError("give text_1 and text_2, or data_1 and data_2")
        if None in self.sides():
            raise ValueError("give both sides: text_1 and text_2 (or data_1 and data_2)")
        return self

    def sides(self) -> tuple[WireItem | _Many | None, WireItem | _Many | None]:
        if self.text_1 is not None or self.text_2 is not None:
            return self.text_1, self.text_2
        return self.data_1, self.data_2
