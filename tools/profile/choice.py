"""What `oval-edge profile` compares and how it picks: the top-k of each page size, one row per page size, the
choice rule and the paragraph that explains it.

Top-k per page size. A sparse decode step reads, per KV head, T = (sink_pages + top_k) * page_size +
max(window, page_size) tokens (OvalConfig.token_budget: the window slots also cover the open page). For a target
B tokens per step, top_k is the k >= 1 whose T is nearest B (a tie goes to the smaller k, so B acts as a budget).
k = 0 is not offered: a step that selects no page is the window-only policy, not OVAL. Large pages can
therefore read more than B (page 128, window 64, one sink page: T = 384 at k = 1).

The choice (issue #26): quality first within a speed tie. Among page sizes that hold the target context in the
budget and whose KL(dense || OVAL) is at most max_kl (a hard ceiling), those whose median decode step is within a
tie tolerance of the fastest one's are equally fast, and of them the lowest KL wins (then the faster median, the
fewer tokens read). The tolerance is --speed-tolerance (default 10%), widened to the fastest row's p25-p75 spread
relative to its median when that is wider: medians that lie inside the step-to-step noise do not rank. "Fastest
under a ceiling" would turn a loose ceiling into the worst-quality choice (page 64 at 3x the KL of page 32 for 4%
of speed, in the issue's run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from oval_edge.config import OvalConfig

T = TypeVar("T")
DEFAULT_SPEED_TOLERANCE = 0.10

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


def check_speed_tolerance(value: float, option: str = "--speed-tolerance") -> float:
    """A tie tolerance as a fraction of the fastest step (0.1 = 10%); ValueError saying what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{option}={value!r} must be a fraction of the fastest step in [0, 1], e.g. 0.1 for 10% "
                         "(0: only the fastest, or what its p25-p75 spread admits)")
    return float(value)


def speed_tie(items: Sequence[T], step_of: Callable[[T], float], tolerance: float) -> list[T]:
    """The items whose step (lower is faster) is within `tolerance` (a fraction) of the fastest's, in input order.

    Shared with `oval-edge plan`, which ranks page sizes by predicted step times the same way."""
    fastest = min(step_of(i) for i in items)
    bound = fastest * (1 + tolerance) * (1 + 1e-12)  # the margin keeps a step at exactly +10% inside despite rounding
    return [i for i in items if step_of(i) <= bound]


@dataclass(frozen=True)
class Ranking:
    """The rule applied to measured rows: `order[0]` is the choice, `order[1]` (if any) the runner-up.

    order: the tied rows by KL (then median), then the rest under the KL ceiling by median (then KL).
    tolerance: the tie tolerance applied, max(asked, spread); spread: the fastest row's (p75 - p25) / median."""

    order: tuple[ProfileRow, ...]
    tied: tuple[ProfileRow, ...]
    fastest: ProfileRow
    asked: float
    spread: float | None
    tolerance: float

    @property
    def chosen(self) -> ProfileRow:
        return self.order[0]

    @property
    def runner_up(self) -> ProfileRow | None:
        return self.order[1] if len(self.order) > 1 else None


def qualifying(rows: list[ProfileRow], max_kl: float) -> list[ProfileRow]:
    return [r for r in rows if r.fits_context and r.decode_ms_median is not None and r.kl is not None
            and r.kl <= max_kl]


def rank(rows: list[ProfileRow], max_kl: float, tokens_per_step: int,
         speed_tolerance: float = DEFAULT_SPEED_TOLERANCE) -> Ranking:
    """Rank the rows that hold the context and keep KL <= max_kl; NoConfiguration (saying what to change) if none."""
    asked = check_speed_tolerance(speed_tolerance)
    ok = qualifying(rows, max_kl)
    if not ok:
        _no_configuration(rows, max_kl, tokens_per_step)
    fastest = min(ok, key=lambda r: (r.decode_ms_median, r.kl, r.tokens_per_step, r.page_size))
    spread = _spread(fastest)
    tolerance = max(asked, spread or 0.0)
    tied = speed_tie(ok, lambda r: r.decode_ms_median, tolerance)
    by_quality = sorted(tied, key=lambda r: (r.kl, r.decode_ms_median, r.tokens_per_step, r.page_size))
    rest = sorted((r for r in ok if r not in tied), key=lambda r: (r.decode_ms_median, r.kl, r.page_size))
    return Ranking(tuple(by_quality + rest), tuple(by_quality), fastest, asked, spread, tolerance)


def choose(rows: list[ProfileRow], max_kl: float, tokens_per_step: int,
           speed_tolerance: float = DEFAULT_SPEED_TOLERANCE) -> ProfileRow:
    """The lowest-KL row among those tied for speed (see the module's docstring)."""
    return rank(rows, max_kl, tokens_per_step, speed_tolerance).chosen


def _no_configuration(rows: list[ProfileRow], max_kl: float, tokens_per_step: int) -> None:
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


def explain(chosen: ProfileRow, rows: list[ProfileRow], max_kl: float, context: int,
            speed_tolerance: float = DEFAULT_SPEED_TOLERANCE, tokens_per_step: int = 0) -> str:
    """One paragraph: what won and why, the runner-up and what was traded, what the others lost on."""
    ranking = rank(rows, max_kl, tokens_per_step, speed_tolerance)
    ok = qualifying(rows, max_kl)
    wider = ranking.spread is not None and ranking.spread > ranking.asked
    widened = (f", widened from --speed-tolerance {ranking.asked:.0%} to the fastest step's p25-p75 spread"
               if wider else " (--speed-tolerance)")
    within = f"{ranking.tolerance:.1%}" if wider else f"{ranking.tolerance:.0%}"  # 10.2% must not read as 10%
    parts = [f"Chose page_size {chosen.page_size} with top_k {chosen.top_k} ({chosen.tokens_per_step} K/V tokens "
             f"read per step), {chosen.decode_ms_median:.1f} ms per decode step at {context} tokens of context, KL "
             f"{chosen.kl:.4g} against dense (top-1 {chosen.top1:.1%}): the lowest KL among the "
             f"{len(ranking.tied)} page size(s) whose median step is within {within} of the fastest"
             f"{widened}, of the {len(ok)} that hold the context with KL at most {max_kl:g}."]
    runner = ranking.runner_up
    if runner is not None:
        where = "also within the tie" if runner in ranking.tied else "outside the tie"
        parts.append(f"Runner-up: page_size {runner.page_size} with top_k {runner.top_k} "
                     f"({runner.decode_ms_median:.1f} ms, KL {runner.kl:.4g}; {where}): {_trade(chosen, runner)}.")
    if ranking.fastest is not chosen and ranking.fastest is not runner:
        f = ranking.fastest
        parts.append(f"The fastest, page_size {f.page_size} ({f.decode_ms_median:.1f} ms), has KL {f.kl:.4g}.")
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


def _trade(chosen: ProfileRow, other: ProfileRow) -> str:
    """What choosing `chosen` over `other` costs and buys, in step time and KL."""
    dt = chosen.decode_ms_median / other.decode_ms_median - 1
    times = f"{chosen.decode_ms_median:.1f} vs {other.decode_ms_median:.1f} ms"
    figures = f"{chosen.kl:.4g} vs {other.kl:.4g}"
    if other.kl > chosen.kl:
        kl = (f"{other.kl / chosen.kl:.1f}x lower KL" if chosen.kl > 0 else "lower KL") + f" ({figures})"
    elif other.kl == chosen.kl:
        kl = f"the same KL ({figures})"
    else:
        kl = (f"{chosen.kl / other.kl:.1f}x the KL" if other.kl > 0 else "a higher KL") + f" ({figures})"
    if dt > 0:
        return f"this choice gives up {dt:.0%} of step time ({times}) for {kl}"
    return f"this choice is {-dt:.0%} faster ({times}) with {kl}"


def _spread(row: ProfileRow) -> float | None:
    if row.decode_ms_p25 is None or row.decode_ms_p75 is None or not row.decode_ms_median:
        return None
    return (row.decode_ms_p75 - row.decode_ms_p25) / row.decode_ms_median
