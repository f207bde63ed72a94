"""Next tokens for a whole batch at once, each row with its own sampling parameters.

Order (as transformers' ``generate``): grammar mask -> repetition penalty -> min_tokens
(EOS banned) -> greedy argmax, or temperature -> top-k -> top-p -> sample. Sampling is
by inverse CDF: one uniform per row, drawn from the row's own ``torch.Generator`` when it
has a seed, so a seeded request samples the same tokens whatever else shares its batch.
Every step is a handful of [B, V] tensor ops; Python loops only visit rows (seeded draws,
grammar, penalties).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.hf.batching.sequence import Sequence

__all__ = ["Sampler"]


class Sampler:
    def __init__(self, vocab_size: int, eos_ids: set[int], device: torch.device):
        self.vocab_size = vocab_size
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        self.device = device
        self._grammar: Any = None  # vlmserve.engine.hf.grammar, imported on first use

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [B, V] float32 (modified in place) -> one token id per row."""
        self._constrain(logits, seqs)
        greedy = [s.sampling.greedy for s in seqs]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        picked = self._draw(logits, seqs, greedy)
        if any(greedy):
            picked = torch.where(
                torch.tensor(greedy, device=self.device), logits.argmax(dim=-1), picked
            )
        return picked.tolist()

    def _constrain(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        grammar_rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if grammar_rows:
            self._apply_grammar(logits, seqs, grammar_rows)
        for i, s in enumerate(seqs):
            penalty = s.sampling.repetition_penalty
            if penalty != 1.0 and s.seen is not None:
                row = logits[i]
                hit = torch.where(row < 0, row * penalty, row / penalty)
                logits[i] = torch.where(s.seen, hit, row)
            if s.run.completion < s.sampling.min_tokens and not s.sampling.ignore_eos:
                logits[i, self.eos] = float("-inf")

    def _apply_grammar(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        if self._grammar is None:
            from vlmserve.engine.hf import grammar  # xgrammar only when a row needs it

            self._grammar = grammar
        masks = self._grammar.allocate_masks(len(seqs), logits.shape[1])
        for i in rows:
            seqs[i].matcher.fill_mask(masks, i)
        self._grammar.apply_masks(logits, masks.to(logits.device), rows)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        temps = torch.tensor(
            [1.0 if g else s.sampling.temperature for s, g in zip(seqs, greedy, strict=True)],
            device=self.device,
        )
        scores = logits / temps[:, None]
        top_k = [0 if g else s.sampling.top_k for s, g in zip(seqs, greedy, strict=True)]
        top_p = [1.0 if g else s.sampling.top_p for s, g in zip(seqs, greedy, strict=True)]
        if any(top_k) or any(p < 1.0 for p in top_p):
            scores = self._top_k_top_p(scores, top_k, top_p)
        return _inverse_cdf(scores.softmax(dim=-1), self._uniforms(seqs))

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One U[0, 1) per row, [B, 1]: a seeded row draws from its own generator."""
        u = torch.rand(len(seqs), 1, device=self.device)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand(1, generator=s.generator, device=self.device)
        return u

    def _top_k_top_p(
        self, scores: torch.Tensor, top_k: list[int], top_p: list[float]
    ) -> torch.Tensor:
        """As transformers' TopK/TopP warpers, vectorised over rows ([B, V] in and out)."""
        vocab = scores.shape[1]
        ordered, order = scores.sort(dim=-1)  # ascending
        if any(top_k):
            k = torch.tensor(top_k, device=self.device)
            kth = (vocab - k.clamp(1, vocab)).where(k > 0, torch.zeros_like(k))
            ordered = ordered.masked_fill(ordered < ordered.gather(1, kth[:, None]), float("-inf"))
        if any(p < 1.0 for p in top_p):
            p = torch.tensor(top_p, device=self.device)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= (1 - p)[:, None]
            drop[:, -1] = False  # keep at least the most likely token
            ordered = ordered.masked_fill(drop, float("-inf"))
        return torch.empty_like(scores).scatter_(1, order, ordered)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row b takes the first token whose cumulative probability exceeds ``u[b] * total``.

    One uniform per row instead of an exponential per vocabulary entry (that race cost
    27 ns per entry on CPU: 0.2 ms a step for 8 rows of a 1k vocabulary, 33 ms for 8 rows of
    Qwen2-VL's 151k). ``u`` stays strictly below the total, so the token found always has
    probability > 0: a token the grammar masked out can never be drawn.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
