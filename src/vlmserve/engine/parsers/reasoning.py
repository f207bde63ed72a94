"""Reasoning parsers: split a thinking model's output into ``reasoning`` and ``content``.

Named like vLLM's ``--reasoning-parser``; both read ``<think>`` ... ``</think>``:

- ``qwen3``: the output is content unless it is inside a think block. Reasoning starts
  either in the prompt (Qwen3-VL-Thinking's template ends with ``<think>\\n``, so the output
  starts inside reasoning and only has ``</think>``) or with a ``<think>`` the model writes
  itself (Qwen3 before 2507). A prompt that closes the block (``enable_thinking: false``
  renders ``<think>\\n\\n</think>\\n\\n``) makes the whole output content.
- ``deepseek_r1``: the output starts inside reasoning (R1 writes no ``<think>``, R1-0528
  writes one first, which is dropped), unless the prompt already closed the block.

In both, a missing ``</think>`` while reasoning means the output was cut off: all of it is
reasoning, as vLLM does. Text is never stripped of whitespace (``"</think>\\n\\nAnswer"``
gives the content ``"\\n\\nAnswer"``), again as vLLM.

    parser = REASONING_PARSERS["qwen3"]
    reasoning, content = parser.split(text, prompt=prompt)         # one shot
    stream = parser.stream(prompt=prompt)                          # incremental
    for delta in deltas: r, c = stream.feed(delta)                  # tags may span deltas
    r, c = stream.finish()                                         # flush held-back text

Feeding any split of a text and then ``finish()`` gives, joined, exactly ``split(text)``
(``None`` reasoning joins as ``""``). The stream holds back at most ``len("</think>") - 1``
characters that may be the start of a tag.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from vlmserve.engine.parsers.text import partial_suffix

__all__ = [
    "REASONING_PARSERS",
    "Phase",
    "ReasoningParser",
    "ReasoningStream",
    "detect_reasoning_parser",
    "prompt_phase",
]

THINK_START = "<think>"
THINK_END = "</think>"


class Phase(enum.Enum):
    """Where the output stands; the prompt decides the first phase."""

    BEFORE = "before"  # content; a <think> opens reasoning
    REASONING = "reasoning"  # reasoning until </think>
    AFTER = "after"  # content to the end, tags are plain text


def prompt_phase(prompt: str | None, start: str = THINK_START, end: str = THINK_END) -> Phase:
    """REASONING if the prompt ends with an open think tag, AFTER if with a closing one.

    Only the very end counts (trailing whitespace aside): a template's generation prompt
    is the last thing in the prompt, and tags a user wrote inside a message are followed by
    the template's turn markers, so they never decide the phase.
    """
    tail = (prompt or "").rstrip()
    if tail.endswith(start):
        return Phase.REASONING
    if tail.endswith(end):
        return Phase.AFTER
    return Phase.BEFORE


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One ``--reasoning-parser``: its tags and where an untagged output starts."""

    name: str
    start: str = THINK_START
    end: str = THINK_END
    # True (deepseek_r1): an output whose prompt has no think tag starts inside reasoning.
    implicit_start: bool = False

    def first_phase(self, prompt: str | None) -> Phase:
        phase = prompt_phase(prompt, self.start, self.end)
        if phase is Phase.BEFORE and self.implicit_start:
            return Phase.REASONING
        return phase

    def split(self, text: str, *, prompt: str | None = None) -> tuple[str | None, str]:
        """The whole output -> (reasoning or None if there was none, content)."""
        phase = self.first_phase(prompt)
        if phase is Phase.AFTER:
            return None, text
        before = ""
        if phase is Phase.BEFORE:
            before, tag, text = text.partition(self.start)
            if not tag:
                return None, before
        elif text.startswith(self.start):  # the model re-opened what the prompt opened
            text = text[len(self.start) :]
        reasoning, tag, after = text.partition(self.end)
        return reasoning, before + after

    def stream(self, *, prompt: str | None = None) -> ReasoningStream:
        """A fresh incremental parser for one output (one per choice; not thread-safe)."""
        return ReasoningStream(self, self.first_phase(prompt))


class ReasoningStream:
    """Feeds text deltas of one output; returns (reasoning_delta, content_delta) each time."""

    __slots__ = ("_at_start", "_parser", "_pending", "first", "phase")

    def __init__(self, parser: ReasoningParser, phase: Phase):
        self._parser = parser
        self.phase = phase
        self.first = phase  # where the prompt left the output (``phase`` moves on)
        self._pending = ""
        # Only an output that starts inside reasoning may drop a leading start tag.
        self._at_start = phase is Phase.REASONING

    @property
    def start_tag(self) -> str:
        """The text that opens the reasoning (``<think>``)."""
        return self._parser.start

    @property
    def end_tag(self) -> str:
        """The text that ends the reasoning (``</think>``)."""
        return self._parser.end

    @property
    def reasoning_at_start(self) -> bool:
        """The prompt opened the reasoning: the output starts inside it."""
        return self.phase is Phase.REASONING and self._at_start

    @property
    def reasoning_ended(self) -> bool:
        """Whether the output is past its reasoning (then e.g. a grammar may start)."""
        return self.phase is Phase.AFTER

    def feed(self, delta: str) -> tuple[str, str]:
        self._pending += delta
        reasoning, content = [], []
        while self._pending:
            before = (self.phase, self._pending)
            if self.phase is Phase.AFTER:
                content.append(self._pending)
                self._pending = ""
            elif self.phase is Phase.BEFORE:
                content.append(self._scan(self._parser.start, Phase.REASONING))
            else:
                if self._at_start and not self._drop_leading_start():
                    break  # could still become the start tag: wait
                reasoning.append(self._scan(self._parser.end, Phase.AFTER))
            if (self.phase, self._pending) == before:
                break  # only a possible tag prefix is left
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: what was held back is text of the current phase."""
        rest, self._pending = self._pending, ""
        if self.phase is Phase.REASONING:
            return rest, ""
        return "", rest

    def _drop_leading_start(self) -> bool:
        """Drop a start tag the output begins with; False while that is still undecided."""
        start = self._parser.start
        if self._pending.startswith(start):
            self._pending = self._pending[len(start) :]
        elif start.startswith(self._pending):
            return False
        self._at_start = False
        return True

    def _scan(self, tag: str, next_phase: Phase) -> str:
        """Emit pending text up to ``tag`` (then switch phase) or up to a possible tag prefix."""
        index = self._pending.find(tag)
        if index >= 0:
            text = self._pending[:index]
            self._pending = self._pending[index + len(tag) :]
            self.phase = next_phase
            return text
        keep = partial_suffix(self._pending, tag)
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
}

# The generation-prompt branch of a template: from the last ``add_generation_prompt`` test on.
_GENERATION_BRANCH = re.compile(r"if\s+add_generation_prompt(?!.*add_generation_prompt)", re.S)


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template implies, or None for a non-thinking template.

    A thinking template writes ``<think>`` in its generation prompt: Qwen3-VL-Thinking and
    Qwen3-*-Thinking-2507 always (``<|im_start|>assistant\\n<think>\\n``), Qwen3's hybrid
    template when ``enable_thinking`` is false (an empty block). DeepSeek-R1's templates use
    ``<｜Assistant｜>`` and a ``</think>`` (history) or ``<think>`` (generation prompt).
    Templates that only strip think blocks from the history (Qwen3-VL-Instruct) are not.
    """
    if not chat_template:
        return None
    if "<｜Assistant｜>" in chat_template and THINK_END in chat_template:
        return "deepseek_r1"
    match = _GENERATION_BRANCH.search(chat_template)
    if match is not None and THINK_START in chat_template[match.end() :]:
        return "deepseek_r1" if "<｜Assistant｜>" in chat_template else "qwen3"
    return None
