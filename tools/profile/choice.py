"""What `oval-edge profile` compares and how it picks: the top-k of each page size, one row per page size, the
choice rule and the paragraph that explains it.

Top-k per page size. A sparse decode step reads, per KV head, T = (sink_pages + top_k) * page_size +
max(window, page_size) tokens (OvalConfig.token_budget: the window slots also cover the open page). For a target
B tokens per step, top_k is the k >= 1 whose T is nearest B (a tie goes to the smaller k, so B acts as a budget).
k = 0 is not offered: a step that selects no page is the window-only policy, not OVAL. Large pages can
therefore read more than B (page 128, window 64, one sink page: T = 384 at k = 1).

The choice: among page sizes that hold the target context in the budget and whose KL(dense || OVAL) is at most
max_kl, the one with the lowest median decode step wins; a tie goes to the lower KL, then the fewer tokens read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from oval_edge.config import OvalConfig

# The fields every JSON row carries first (issue #7), then the supporting figures.
ROW_FIELDS = ("page_size", "top_k", "tokens_per_step", "pages", "max_context", "summary_bytes", "decode_ms_median",
              "seal_ms", "kl", "top1")


class NoConfiguration(ValueError):
    """No profiled page size meets the quality bar (or holds the context); the message says what to change."""


@dataclass
class ProfileRow:
    """One page size as measured on this device. Figures that could not be measured are None (see `note`).

    pages / pool_tokens: the pool the memory budget buys at this page size (pages x page_size tokens);
    max_context:         the longest request it admits (prompt + max_tokens, capped by the model's positions).
    summary_bytes:       the pool's page summaries (all pages, layers, KV heads); summary_bytes_per_page per page.
    decode_ms_median:    median wall time of one engine decode step at the target context (p25/p75: its spread).
    seal_ms:             median wall time to seal (summarise) the pages of one prefill chunk, batched as the pool
                         does; seal_page_ms for one page, what a decode step pays each time a page fills.
    kl, top1, ppl:       teacher-forced fidelity of OVAL at (page_size, top_k) against dense, same weights.
    """

    page_size: int
    top_k: int
    tokens_per_step: int
    pages: int | None = None
    pool_tokens: int | None = None
    max_context: int | None = None
    summary_bytes: int | None = None
    decode_ms_median: float | None = None
    seal_ms: float | None = None
    kl: float | None = None
    top1: float | None = None
    fits_context: bool = False
    bytes_per_page: int | None = None
    summary_bytes_per_page: int | None = None
    pool_bytes: int | None = None
    decode_ms_p25: float | None = None
    decode_ms_p75: float | None = None
    decode_steps: int = 0
    interleaved: bool = False  # timed in turn with the other page sizes (see tools/profile/measure.py)
    seal_page_ms: float | None = None
    seal_pages: int | None = None
    kv_bytes_per_step: int | None = None
    ppl: float | None = None
    fidelity_steps: int = 0
    note: str = ""

    def record(self) -> dict:
        values = asdict(self)
        ordered = {name: values.pop(name) for name in ROW_FIELDS}
        ordered.update(values)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in ordered.items()}

    @property
    def label(self) -> str:
        return f"page {self.page_size}, top-k {self.top_k}"


def top_k_for(page_size: int, tokens_per_step: int, base: OvalConfig) -> int:
    """The k >= 1 whose token budget (sink + k) * P + max(window, P) is nearest `tokens_per_step`."""
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
        raise ValueError(f"--tokens-per-step={tokens_per_step!r} must be a positive integer (K/V tokens per step)")
    config = base.replace(page_size=page_size, top_k=1)
    fixed = config.token_budget - page_size  # sink pages + window slots: read whatever k is
    ideal = (tokens_per_step - fixed) / page_size
    candidates = {max(1, math.floor(ideal)), max(1, math.ceil(ideal))}
    return min(candidates, key=lambda k: (abs(fixed + k * page_size - tokens_per_step), k))


def qualifying(rows: list[ProfileRow], max_kl: float) -> list[ProfileRow]:
    return [r for r in rows if r.fits_context and r.decode_ms_median is not None and r.kl is not None
            and r.kl <= max_kl]


def choose(rows: list[ProfileRow], max_kl: float, tokens_per_step: int) -> ProfileRow:
    """The fastest row with KL <= max_kl that holds the context; NoConfiguration (saying what to change) if none."""
    ok = qualifying(rows, max_kl)
    if ok:
        return min(ok, key=lambda r: (r.decode_ms_median, r.kl, r.tokens_per_step, r.page_size))
    measured = [r for r in rows if r.fits_context and r.kl is not None]
    if not measured:
        raise NoConfiguration(
            "no page size holds the target context in this memory budget; raise --memory-budget or lower --context "
            f"(longest context per page size: {', '.join(f'{r.page_size}: {r.max_context}' for r in rows)})")
    best = min(measured, key=lambda r: r.kl)
    raise NoConfiguration(
        f"no page size keeps KL <= --max-kl {max_kl:g} at about {tokens_per_step} tokens read per step: the lowest "
        f"KL was {best.kl:.4g} ({best.label}, {best.tokens_per_step} tokens per step). Raise --tokens-per-step "
        f"(e.g. {2 * tokens_per_step}: more pages per step, better fidelity, slower steps) or raise --max-kl to "
        f"{best.kl:.3g} or more; no configuration was written")


def explain(chosen: ProfileRow, rows: list[ProfileRow], max_kl: float, context: int) -> str:
    """One paragraph: what won, by how much, what the others lost on (too slow, over the KL bar, no room)."""
    ok = qualifying(rows, max_kl)
    parts = [f"Chose page_size {chosen.page_size} with top_k {chosen.top_k} ({chosen.tokens_per_step} K/V tokens "
             f"read per step): the fastest median decode step at {context} tokens of context "
             f"({chosen.decode_ms_median:.1f} ms) among the {len(ok)} page size(s) whose KL against dense is at most "
             f"{max_kl:g} (its KL {chosen.kl:.4g}, top-1 {chosen.top1:.1%})."]
    rivals = sorted((r for r in ok if r is not chosen), key=lambda r: r.decode_ms_median)
    if rivals:
        runner = rivals[0]
        gap = runner.decode_ms_median / chosen.decode_ms_median - 1
        spread = _spread(chosen)
        within = (f"; that gap is within the step-to-step spread ({spread:.0%} interquartile), so treat the two as "
                  "equally fast" if spread is not None and gap <= spread else "")
        parts.append(f"Next was page_size {runner.page_size} at {runner.decode_ms_median:.1f} ms (+{gap:.0%}, KL "
                     f"{runner.kl:.4g}){within}.")
    over = [r for r in rows if r.kl is not None and r.kl > max_kl]
    if over:
        parts.append("Over the KL bar: " + ", ".join(f"page_size {r.page_size} (KL {r.kl:.4g})" for r in over) + ".")
    short = [r for r in rows if not r.fits_context]
    if short:
        parts.append("Not holding the context in this budget: "
                     + ", ".join(f"page_size {r.page_size} (up to {r.max_context} tokens)" for r in short) + ".")
    parts.append(f"The pool holds {chosen.pages} pages ({chosen.max_context} tokens per request), of which page "
                 f"summaries take {chosen.summary_bytes / 2**20:.1f} MiB.")
    return " ".join(parts)


def _spread(row: ProfileRow) -> float | None:
    if row.decode_ms_p25 is None or row.decode_ms_p75 is None or not row.decode_ms_median:
        return None
    return (row.decode_ms_p75 - row.decode_ms_p25) / row.decode_ms_median
