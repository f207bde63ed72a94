"""`/v1/chat/completions` request shapes: OpenAI's, extra media parts, vLLM extras."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlmserve.api.common.fields import CHAT_FIELDS, unknown_in_messages
from vlmserve.api.common.guards import AllowedTokenIds, RepetitionDetectionIn, ThinkingTokenBudget
from vlmserve.api.common.lists import MAX_MESSAGES, counted_first
from vlmserve.api.common.text import UnicodeText, valid_unicode

__all__ = [
    "ChatCompletionRequest",
    "ChatMessageIn",
    "ContentPart",
    "ImageUrlPart",
    "InputImagePart",
    "InputVideoPart",
    "MediaUuid",
    "StreamOptions",
    "TextContentPart",
    "VideoUrlPart",
    "auto_detail",
]

_INT64 = 2**63 - 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UrlRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str
    detail: str | None = None

    @field_validator("detail")
    @classmethod
    def _detail(cls, value: str | None) -> str | None:
        return auto_detail(value)


def auto_detail(value: str | None) -> str | None:
    """``detail``: ``low``, ``high`` or ``auto``, the image's pixel budget by the model's family
    (``engine/models/families/_media.py``)."""
    if value not in (None, "auto", "low", "high"):
        raise ValueError(f"detail {value!r} is not one of 'low', 'high' or 'auto'")
    return value


MediaUuid = Annotated[str, Field(min_length=1, max_length=256)]


class _MediaPart(_Part):
    """A media part may carry ``uuid`` (vLLM's per-item id): a later request of the same API
    key may send the part with the ``uuid`` and no data (``api/common/media_refs.py``)."""

    uuid: MediaUuid | None = None

    @property
    def source(self) -> str:
        raise NotImplementedError

    @property
    def has_data(self) -> bool:
        try:
            return bool(self.source)
        except ValueError:
            return False


class TextContentPart(_Part):
    type: Literal["text", "input_text"]
    text: UnicodeText


class ImageUrlPart(_MediaPart):
    type: Literal["image_url"]
    image_url: str | UrlRef | None = None  # None: by reference (``uuid``)

    @property
    def source(self) -> str:
        if self.image_url is None:
            raise ValueError("image_url needs url (or a uuid sent with the image before)")
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url

    @property
    def detail(self) -> str | None:
        return self.image_url.detail if isinstance(self.image_url, UrlRef) else None


class InputImagePart(_MediaPart):
    type: Literal["input_image"]
    b64_json: str | None = None
    image: str | None = None
    image_url: str | UrlRef | None = None

    @property
    def source(self) -> str:
        ref = self.b64_json or self.image or self.image_url
        if ref is None:
            raise ValueError("input_image needs one of b64_json, image or image_url")
        return ref if isinstance(ref, str) else ref.url

    @property
    def detail(self) -> str | None:
        return self.image_url.detail if isinstance(self.image_url, UrlRef) else None


class VideoUrlPart(_MediaPart):
    type: Literal["video_url"]
    video_url: str | UrlRef | None = None  # None: by reference (``uuid``)

    @property
    def source(self) -> str:
        if self.video_url is None:
            raise ValueError("video_url needs url (or a uuid sent with the video before)")
        return self.video_url if isinstance(self.video_url, str) else self.video_url.url


class InputVideoPart(_MediaPart):
    """A video file (``b64_json``, ``video``, ``video_url``), or a clip as its ``frames``
    (base64 JPEG/PNG or image URLs, in order; the GPU worker's form, sampled to
    VLMSERVE_MAX_VIDEO_FRAMES before decoding)."""

    type: Literal["input_video"]
    b64_json: str | None = None
    video: str | None = None
    video_url: str | UrlRef | None = None
    frames: list[str] | None = None

    @property
    def has_data(self) -> bool:
        return self.frames is not None or bool(self.b64_json or self.video or self.video_url)

    @property
    def source(self) -> str:
        ref = self.b64_json or self.video or self.video_url
        if ref is None:
            raise ValueError("input_video needs one of b64_json, video, video_url or frames")
        return ref if isinstance(ref, str) else ref.url


ContentPart = Annotated[
    TextContentPart | ImageUrlPart | InputImagePart | VideoUrlPart | InputVideoPart,
    Field(discriminator="type"),
]


class ChatMessageIn(BaseModel):
    # undeclared fields are checked against api/common/fields.py's MESSAGE_FIELDS
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: UnicodeText | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)  # assistant turns
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool results
    reasoning_content: UnicodeText | None = None  # a thinking model's earlier reasoning
    reasoning: UnicodeText | None = None  # the same, under vLLM's newer name

    @property
    def earlier_reasoning(self) -> str | None:
        return self.reasoning_content or self.reasoning


class ToolCallIn(BaseModel):
    """An earlier assistant turn's call (sent back by agents with the tool's result)."""

    model_config = ConfigDict(extra="allow")
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: dict[str, Any]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # vlmserve: True = `id:`/`event:` lines (resumable wire), False = `data:` lines only,
    # None = decided by the request (Accept: text/event-stream, Last-Event-ID)
    resumable: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=512)
    messages: Annotated[list[ChatMessageIn], counted_first(MAX_MESSAGES)] = Field(
        min_length=1, max_length=MAX_MESSAGES
    )
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # at most 20 (checked: a clear 400)
    logit_bias: dict[str, float] | None = None  # {"token id": -100..100}
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | a function
    parallel_tool_calls: bool | None = None
    # thinking models (vLLM's fields): template switches (enable_thinking), and whether the
    # answer carries the reasoning
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    user: str | None = None
    # vLLM-compatible extras (benchmarks need fixed output lengths)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # resumable streams
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    # vLLM's per-request media controls, bounded by the server's caps
    # (api/common/media_controls.py): {"min_pixels", "max_pixels", "fps", "num_frames"} and
    # {"video": {"num_frames", "fps"}}
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    # vLLM's: a secret that keeps this request's prefix-cache entries apart from other
    # tenants' (only requests with the same salt share cached blocks)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # per-request timings in the answer (``api/common/timings.py``); None: the server's choice
    include_metrics: bool | None = None
    # vLLM's output guards (``api/common/guards.py``)
    repetition_detection: RepetitionDetectionIn | None = None
    thinking_token_budget: ThinkingTokenBudget = None
    allowed_token_ids: AllowedTokenIds = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > 16 or any(len(s) > 256 for s in stops)):
            raise ValueError("at most 16 stop strings of at most 256 characters each")
        return [valid_unicode(s) for s in stops] if stops is not None else None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > 12:
                raise ValueError(f"keys are token ids (non-negative integers), not {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise ValueError(f"token {key}: the bias {bias} is outside -100..100")
        return value

    @field_validator("session_id")
    @classmethod
    def _session_id(cls, value: str | None) -> str | None:
        if value is not None and not all(c.isalnum() or c in "-_." for c in value):
            raise ValueError("session_id may contain only letters, digits, '-', '_' and '.'")
        return value

    @property
    def unknown_fields(self) -> list[str]:
        """Fields neither served, nor no-ops, nor refused (``api/common/fields.py``)."""
        extras = [m.model_extra or {} for m in self.messages]
        return CHAT_FIELDS.unknown(self.model_extra or {}) + unknown_in_messages(extras)
