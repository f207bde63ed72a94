"""Internal request/response types shared by every backend (no pydantic, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "BATCH_PRIORITY",
    "GREEDY_BELOW",
    "INTERACTIVE_PRIORITY",
    "MIN_PENALTY",
    "MIN_TEMPERATURE",
    "BackendStats",
    "ChatMessage",
    "Chunk",
    "EmbedInput",
    "FinishReason",
    "GenerateRequest",
    "ImagePart",
    "MediaOptions",
    "ModelState",
    "OutputOptions",
    "Part",
    "RepetitionDetection",
    "SamplingParams",
    "ScorePair",
    "Scored",
    "Serves",
    "TextPart",
    "VideoPart",
]


class ModelState(str, enum.Enum):
    """Where a backend's model is: ``READY`` serves requests, the others answer 503."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class Serves(str, enum.Enum):
    """What a backend answers: chat-style generation, embeddings, or relevance scores
    (a cross-encoder reranker)."""

    CHAT = "chat"
    EMBEDDING = "embedding"
    RERANK = "rerank"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"
    ERROR = "error"
    # vLLM's: ``repetition_detection`` found the output looping (its ``FinishReason.REPETITION``)
    REPETITION = "repetition"


# Degenerate sampling values, as vLLM treats them (``vllm/sampling_params.py``): a temperature
# below ``_SAMPLING_EPS`` (1e-5) means greedy; one below ``_MAX_TEMP`` (1e-2) is raised to it,
# since logits / 1e-30 overflow float32 (inf - inf = NaN in the softmax). A repetition penalty
# is any positive number (vLLM refuses only <= 0); the sampler bounds the factor so that
# penalised logits stay finite: 1e-300 acts as MIN_PENALTY, 1e300 as 1 / MIN_PENALTY.
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 1e-2
MIN_PENALTY = 1e-6


@dataclass(frozen=True, slots=True)
class RepetitionDetection:
    """vLLM's ``RepetitionDetectionParams``: stop (finish reason ``repetition``) once the
    output ends with a pattern of ``min_pattern_size``..``max_pattern_size`` tokens repeated
    ``min_count`` times in a row (``engine/guards.py``)."""

    max_pattern_size: int
    min_pattern_size: int = 0  # 0 counts as 1
    min_count: int = 2


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    # OpenAI's additive penalties over the tokens generated so far (prompt excluded):
    # logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False  # each sampled token's log-probability (raw logits by default)
    top_logprobs: int = 0  # and this many most likely alternatives (0..20)
    n: int = 1  # choices; choice i samples with seed + i (one shared prefill when batched)
    # OpenAI's logit_bias: {token id: -100..100} added to the logits before sampling
    logit_bias: dict[int, float] = field(default_factory=dict)
    # output guards (vLLM's fields): stop a looping output; end a thinking model's reasoning
    # after this many tokens (None: unlimited); sample only among these token ids
    repetition_detection: RepetitionDetection | None = None
    thinking_token_budget: int | None = None
    allowed_token_ids: list[int] | None = None

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one too small to sample with (below 1e-5)."""
        return not self.temperature >= GREEDY_BELOW  # NaN counts as greedy too

    @property
    def sampling_temperature(self) -> float:
        """The temperature the sampler divides by (non-greedy rows): at least 1e-2."""
        return max(self.temperature, MIN_TEMPERATURE)

    @property
    def additive_penalties(self) -> bool:
        """Whether presence/frequency penalties apply (either is non-zero)."""
        return bool(self.presence_penalty or self.frequency_penalty)

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice ``index`` (``n`` > 1): ``seed + index``, documented."""
        return None if self.seed is None else self.seed + index

    @property
    def penalty(self) -> float:
        """The repetition penalty bounded to [1e-6, 1e6] (1.0 = off; NaN counts as off)."""
        p = self.repetition_penalty
        return min(max(p, MIN_PENALTY), 1 / MIN_PENALTY) if p == p else 1.0


@dataclass(slots=True)
class TextPart:
    text: str


@dataclass(slots=True)
class ImagePart:
    image: Image.Image


@dataclass(slots=True)
class VideoPart:
    """Frames of one video, and where on the clip's timeline they were taken.

    ``fps`` is the frame rate of the timeline ``frame_indices`` count on: the source clip's
    fps when the frames were sampled from a clip (``vlmserve.media.video``), else the rate of
    ``frames`` themselves. Without ``frame_indices`` the frames are consecutive (0, 1, 2, ...)
    on a clip of ``len(frames)`` frames. Processors that timestamp frames (Qwen2.5-VL's
    ``second_per_grid_ts``, Qwen3-VL's and SmolVLM's prompt timestamps) get them from here.
    """

    frames: list[Image.Image]
    fps: float | None = None
    frame_indices: list[int] | None = None  # source index of each frame, ascending
    total_frames: int | None = None  # frames in the source clip


Part = TextPart | ImagePart | VideoPart


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: list[Part]
    # history an agent sends back: an assistant turn's calls (OpenAI shape), a tool result's
    # call id, a thinking model's earlier reasoning; the chat template renders them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


INTERACTIVE_PRIORITY = 0  # a client waits for the answer
BATCH_PRIORITY = 1  # /v1/batches lines: admitted after waiting interactive requests


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    messages: list[ChatMessage]
    sampling: SamplingParams
    # Tokens already generated (and sent) by an earlier run of this request: the engine
    # appends them to the prompt and continues after them (stream resume across restarts).
    prefix_token_ids: list[int] = field(default_factory=list)
    # OpenAI ``response_format`` ({"type": "json_object"} or {"type": "json_schema", ...});
    # None: free text. The hf engine enforces it token by token; upstreams receive it as is.
    response_format: dict[str, Any] | None = None
    # The wire request body, for backends that forward it (upstream proxies) instead of
    # running the model here.
    raw: dict[str, Any] | None = None
    output: OutputOptions = field(default_factory=lambda: OutputOptions())
    # Admission class (lower first): the scheduler lets waiting interactive requests overtake
    # waiting batch work, a bounded number of times each (never starving it).
    priority: int = INTERACTIVE_PRIORITY
    # Prefix caching: only requests with the same salt share cached K/V blocks (vLLM's
    # ``cache_salt``, against another tenant timing the cache to guess prompts).
    cache_salt: str | None = None
    media: MediaOptions = field(default_factory=lambda: MediaOptions())

    @property
    def has_media(self) -> bool:
        """Whether any message carries an image or a video (its prompt needs the vision
        tower)."""
        return any(isinstance(p, ImagePart | VideoPart) for m in self.messages for p in m.content)


@dataclass(slots=True)
class MediaOptions:
    """A request's own media processing: ``mm_processor_kwargs``' pixel budgets
    (``min_pixels``, ``max_pixels``) and the images' ``detail``; the backend maps ``detail``
    to its family's budget and refuses a budget its processor does not have. (Frame choice,
    ``fps`` and ``num_frames``, is applied where the video is decoded.)"""

    processor_kwargs: dict[str, int] = field(default_factory=dict)
    detail: str | None = None  # low | high | auto (None: auto)


@dataclass(slots=True)
class OutputOptions:
    """How the answer is rendered and read back: template switches, tools, reasoning."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, given to the template
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # False: the reasoning is dropped from the answer
    # tool_choice required/named: the grammar makes the whole answer bare JSON calls
    enforced_tool_calls: bool = False

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(slots=True)
class Chunk:
    """One step of a generation: new text (may be empty) and the token ids behind it."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning: str = ""  # new reasoning text (thinking models), kept out of ``text``
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI streaming tool_call deltas
    # OpenAI ``logprobs.content`` items of ``token_ids`` ({token, logprob, bytes,
    # top_logprobs}); None when the request did not ask for logprobs
    logprobs: list[dict[str, Any]] | None = None
    index: int = 0  # the choice this chunk belongs to (``n`` > 1)
    cached_tokens: int | None = None  # prompt tokens from the prefix cache (None: not caching)
    # On a finish chunk: where the request's time went, in seconds by phase. The engine fills
    # queue, vision, prefill, decode; the API adds media and e2e. None: not timed.
    timings: dict[str, float] | None = None

    def merged(self, then: Chunk) -> Chunk:
        """This chunk followed by ``then`` (same choice) as one chunk."""
        logprobs = None
        if self.logprobs is not None or then.logprobs is not None:
            logprobs = (self.logprobs or []) + (then.logprobs or [])
        return Chunk(
            text=self.text + then.text,
            token_ids=self.token_ids + then.token_ids,
            finish_reason=then.finish_reason,
            prompt_tokens=then.prompt_tokens,
            completion_tokens=then.completion_tokens,
            reasoning=self.reasoning + then.reasoning,
            tool_calls=(self.tool_calls or []) + (then.tool_calls or []) or None,
            logprobs=logprobs,
            cached_tokens=then.cached_tokens,
            index=self.index,
            timings=then.timings or self.timings,
        )


@dataclass(slots=True)
class Tokenized:
    """A prompt as the model reads it (``Backend.tokenize``): its token ids, and the model's
    context limit (prompt + completion)."""

    ids: list[int]
    max_model_len: int


@dataclass(slots=True)
class EmbedInput:
    """One thing to embed: text, an image, video frames, or text with an image or frames."""

    text: str | None = None
    image: Image.Image | None = None
    frames: list[Image.Image] | None = None


@dataclass(slots=True)
class ScorePair:
    """One query-document pair to score; each side is text, an image, frames, or text with
    one of them. ``max_doc_tokens``: the document's text is cut to that many tokens (None:
    a pair over the model's context is refused)."""

    query: EmbedInput
    document: EmbedInput
    max_doc_tokens: int | None = None


@dataclass(slots=True)
class Scored:
    """The relevance of each pair (in order; higher is more relevant) and the prompt tokens
    read to compute them."""

    scores: list[float]
    prompt_tokens: int = 0


@dataclass(slots=True)
class BackendStats:
    """A backend's numbers for ``/metrics``, read at scrape time.

    ``running``/``waiting`` are None when the backend cannot tell (the manager then counts
    leases); ``kv_usage`` is the share of the KV cache (or sequence slots) in use.
    """

    running: int | None = None
    waiting: int | None = None
    kv_usage: float = 0.0
    preemptions: int = 0
    prefix_cache: tuple[int, int] = (0, 0)  # prompt tokens (queried, hit) in the prefix cache
    kv_cache_bytes: int = 0
    vision_cache: dict[str, int] | None = None
    processor_cache: dict[str, int] | None = None
    engine_failures: int = 0
    last_engine_error: str | None = None
    step_seconds: dict[str, float] | None = None  # engine step time by phase, running totals
    weights_bytes: int = 0  # memory held by the model's weights
    device_memory_bytes: int = 0  # accelerator memory torch has allocated (0 on CPU)
    process_rss_bytes: int = 0  # resident memory of the model's engine process (0: none)
    # liveness: seconds its engine has had work without a step starting or ending (0: none
    # pending), and the longest step it ran
    stalled_seconds: float = 0.0
    longest_step_seconds: float = 0.0
