"""Sampling parameters (validated like the OpenAI API validates them) and the per-row sampler.

One row's logits go through, in order: repetition, presence and frequency penalties, logit_bias, the grammar's
token mask (response_format / tools); those are the *processed* logits, whose log-softmax is what `logprobs`
reports (so a logprob is the one the model's distribution gave after the request's own rules, before temperature
and truncation). Then greedy takes their argmax; sampling divides by the temperature and applies top_k, min_p and
top_p before drawing with the request's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from .logits import apply_logit_bias, apply_presence_frequency, apply_repetition, min_p_filter, top_logprobs

MAX_STOP_STRINGS = 8
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


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
    presence_penalty: float = 0.0  # [-2, 2], over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2], over generated tokens
    repetition_penalty: float = 1.0  # (0, 2], over prompt + generated tokens; 1 = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    logprobs: int | None = None  # None = off; else how many top alternatives per token (0..20)
    grammar: object | None = field(default=None, compare=False)  # a compiled grammar (grammar.py), None = free

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        for name, low, high in (("temperature", 0.0, 2.0), ("presence_penalty", -2.0, 2.0),
                                ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not _number(value) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} is out of range: allowed [{low:g}, {high:g}]")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is out of range: allowed (0, 1]")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} is out of range: allowed (0, 2] "
                             "(1 = off, above 1 discourages repeats)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r}: give at most {MAX_STOP_STRINGS} non-empty strings")
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError(f"logit_bias={self.logit_bias!r}: token ids must be >= 0 and biases in [-100, 100]")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", bias)

    @property
    def penalised(self) -> bool:
        """Any processor before the grammar mask is on (the plain greedy path skips the host copy without)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


class Sample(NamedTuple):
    token: int
    logprob: float | None = None  # of `token` under the processed logits (None when logprobs are off)
    top: tuple[tuple[int, float], ...] = ()  # the most likely (id, logprob), params.logprobs of them


@dataclass
class RowSampler:
    """Draws one request's tokens; owns its generator so a seed reproduces the output in any batch."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    def __post_init__(self) -> None:
        if self.params.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed if self.params.seed is not None else torch.seed())

    def process(self, logits: torch.Tensor, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The processed logits [vocab] float32 on the host: penalties, logit_bias, then the grammar's mask
        (`allowed`: [vocab] bool, True where the grammar accepts the token)."""
        p = self.params
        logits = logits.float().cpu()
        if p.repetition_penalty != 1.0:
            logits = apply_repetition(logits, list(prompt_ids) + list(output_ids), p.repetition_penalty)
        logits = apply_presence_frequency(logits, output_ids, p.presence_penalty, p.frequency_penalty)
        logits = apply_logit_bias(logits, p.logit_bias)
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
        return logits

    def sample(self, logits: torch.Tensor) -> int:
        """logits [vocab] -> token id, with no history (no penalties) and no grammar (the eval tool's rows)."""
        return self.choose(logits).token

    def choose(self, logits: torch.Tensor, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
               allowed: torch.Tensor | None = None) -> Sample:
        """logits [vocab] -> the next token (and its logprobs when the request asked for them)."""
        p = self.params
        greedy = p.temperature < torch.finfo(torch.float32).tiny  # below it a temperature would divide by 0
        if greedy and allowed is None and not p.penalised and p.logprobs is None:
            return Sample(int(torch.argmax(logits)))  # the common path: no host copy of the row
        logits = self.process(logits, prompt_ids, output_ids, allowed)
        token = int(torch.argmax(logits)) if greedy else self._draw(logits)
        if p.logprobs is None:
            return Sample(token)
        logprobs = torch.log_softmax(logits, dim=-1)
        return Sample(token, float(logprobs[token]), tuple(top_logprobs(logprobs, p.logprobs)))

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        # Shift by the max first: a tiny temperature then sends the others to -inf instead of overflowing to inf
        # (inf - inf = NaN in the softmax); the softmax is shift-invariant, so nothing else changes.
        logits = (logits - logits.max()) / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = min_p_filter(torch.softmax(logits, dim=-1), p.min_p)
        if p.top_p < 1.0:
            if p.min_p > 0.0:  # top_p's mass is of what min_p kept
                probs = probs / probs.sum()
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
            drop[0] = False  # also when top_p is below float32 resolution (it rounds to 0, and 0 >= 0)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
