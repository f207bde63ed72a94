"""Prefill paced against the running streams' decode (``--decode-share``).

While streams decode, a step that prefills a newcomer stalls all of them for its whole
prompt: on a 2-core CPU a 2,048-token prompt of the medium test checkpoint takes about a
second, a decode step of 8 rows 36 ms. Scheduling a waiting prompt whenever one waits (vLLM's
way, in chunks) spends nearly all of the engine's time prefilling once long prompts keep
arriving, and each stream's tokens come in bursts between one-second stalls.

``Pacing`` keeps a share of the engine's time for the streams: a step that prefilled for S
seconds while streams decoded owes them S x share / (1 - share) seconds of decode-only steps
before the next prefill step (a newcomer's, or the next chunk of a long prompt). Prompts are
never held while no stream decodes, nor while at least as many prompts wait as streams
decode (holding then would serve a few streams at the cost of many): one request at a time,
or a burst arriving together, is scheduled as before. TGI's ``max_waiting_tokens`` is the
same idea counted in steps; counted in seconds it does not depend on the model, the prompts'
lengths or the hardware.
"""

from __future__ import annotations

__all__ = ["Pacing"]


class Pacing:
    def __init__(self, share: float) -> None:
        """``share``: the least share of the engine's time the streams decode alone while
        prompts wait, in [0, 1); 0 never holds a prompt."""
        if not 0.0 <= share < 1.0:
            raise ValueError(f"decode share {share} is not in [0, 1)")
        self.ratio = share / (1.0 - share)  # decode seconds owed per prefill second
        self.owed = 0.0  # decode-only seconds the streams are owed before the next prefill
        self.holds = 0  # steps a waiting prompt was held for the streams (a counter)

    def hold(self, streams: int, pending: int) -> bool:
        """Whether this step prefills nothing: ``streams`` rows decode, ``pending`` prompts
        (or chunks of them) wait, and the streams are still owed decode time."""
        if streams == 0:
            self.owed = 0.0  # nobody to owe
        if self.owed <= 0.0 or pending == 0 or pending >= streams:
            return False
        self.holds += 1
        return True

    def prefilled(self, seconds: float, streams: int) -> None:
        """A step prefilled for ``seconds`` with ``streams`` rows decoding (riding in it or
        waiting for it)."""
        if streams:
            self.owed = seconds * self.ratio

    def decoded(self, seconds: float) -> None:
        """A decode-only step took ``seconds``."""
        self.owed = max(0.0, self.owed - seconds)
