"""Sampling parameters (validated like the OpenAI API validates them) and the per-row sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_STOP_STRINGS = 8


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not _number(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature={self.temperature!r} is out of range: allowed [0, 2] (0 = greedy)")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is out of range: allowed (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r}: give at most {MAX_STOP_STRINGS} non-empty strings")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


@dataclass
class RowSampler:
    """Draws one request's tokens; owns its generator so a seed reproduces the output in any batch."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    def __post_init__(self) -> None:
        if self.params.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed if self.params.seed is not None else torch.seed())

    def sample(self, logits: torch.Tensor) -> int:
        """logits [vocab] float32 -> token id."""
        p = self.params
        # Below float32's smallest normal number a temperature would divide by 0: use its limit, greedy.
        if p.temperature < torch.finfo(torch.float32).tiny:
            return int(torch.argmax(logits))
        logits = logits.float().cpu()
        # Shift by the max first: a tiny temperature then sends the others to -inf instead of overflowing to inf
        # (inf - inf = NaN in the softmax); the softmax is shift-invariant, so nothing else changes.
        logits = (logits - logits.max()) / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
            drop[0] = False  # also when top_p is below float32 resolution (it rounds to 0, and 0 >= 0)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
