"""The decode policies `oval-edge eval` compares, and how each one maps onto the runtime's OvalConfig.

Every policy except `dense` reads the same number of K/V slots per KV head at a sparse decode step,
T = (sink_pages + top_k) * page_size + max(window, page_size), so they are compared at equal budget:

    dense    every cached token (attention="dense"): the reference the others are measured against
    window   sink pages + one longer local window of T - sink tokens; nothing from the middle
    quest    sink + top-k pages by Quest's per-channel min/max bound + window
    oval     sink + top-k pages by the output-aware local basis (built at seal time with this row's eta) + window
    oracle   sink + top-k pages by their true attention mass (dense logits over every cached key) + window;
             the reference ceiling, the only policy allowed to read all keys

Window policies (oval pages, but each KV head's window varies per step within a range [lo, hi]; they gather
sink + k pages + max(hi, page) slots and attend a varying part of them, so compare them at equal *average*
tokens attended per step: pick lo, hi so that their mean window matches the fixed window):
    entropy  the window from the entropy of the candidate-page scores ([R-window])
    module   the window from the calibrated output-aware module ([R-window-module], `oval-edge calibrate`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from oval_edge.config import OvalConfig
from oval_edge.sparse.selection import slots_per_step

POLICY_NAMES = ("dense", "window", "quest", "oval", "oracle")
SCORED = ("quest", "oval", "oracle")  # policies that pick top-k pages with a page scorer
WINDOW_POLICIES = ("entropy", "module")  # oval pages with a per-head window in a range
ALL_POLICIES = POLICY_NAMES + WINDOW_POLICIES
OVAL_PAGES = ("oval",) + WINDOW_POLICIES  # policies whose pages are sealed with an eta


@dataclass(frozen=True)
class Policy:
    name: str
    top_k: int | None = None  # None for dense
    eta: float | None = None  # oval pages only: the output-aware mix its page summaries are built with
    window: tuple[int, int] | None = None  # window policies only: the (lo, hi) range of each head's window
    reuse_tau: float | None = None  # oval only: reuse a recent selection at query cosine >= tau (tools/eval/reuse)
    group_pages: int = 0  # oval only: two-level scoring with coarse groups of this many pages (sparse/grouped.py)

    def __post_init__(self) -> None:
        if self.name not in ALL_POLICIES:
            raise ValueError(f"policy {self.name!r} is unknown; allowed: {', '.join(ALL_POLICIES)}")
        if (self.name == "dense") != (self.top_k is None):
            raise ValueError(f"policy {self.name!r}: top_k must be None for dense and an integer otherwise")
        if (self.name in OVAL_PAGES) != (self.eta is not None):
            raise ValueError(f"policy {self.name!r}: eta is set for {', '.join(OVAL_PAGES)} rows only")
        if (self.name in WINDOW_POLICIES) != (self.window is not None):
            raise ValueError(f"policy {self.name!r}: a window range is set for {', '.join(WINDOW_POLICIES)} rows only")
        if self.reuse_tau is not None and (self.name != "oval" or not 0.0 < self.reuse_tau <= 1.0):
            raise ValueError(f"policy {self.name!r}: reuse_tau={self.reuse_tau!r} needs an oval row and (0, 1]")
        if self.group_pages and (self.name != "oval" or self.reuse_tau is not None or self.group_pages < 2):
            raise ValueError(f"policy {self.name!r}: group_pages={self.group_pages} needs an oval row without reuse "
                             "and at least 2 pages a group")

    @property
    def label(self) -> str:
        if self.name == "dense":
            return "dense"
        if self.name == "oval":
            reuse = f" reuse τ={self.reuse_tau:g}" if self.reuse_tau is not None else ""
            grouped = f" groups of {self.group_pages}" if self.group_pages else ""
            return f"oval eta={self.eta:g}{reuse}{grouped} k={self.top_k}"
        if self.name in WINDOW_POLICIES:
            return f"{self.family} k={self.top_k}"
        return f"{self.name} k={self.top_k}"

    @property
    def family(self) -> str:
        """One plotted line per family: the policy, with its eta for oval."""
        if self.name in WINDOW_POLICIES:
            return f"{self.name} W{self.window[0]}-{self.window[1]}"
        if self.name == "oval" and self.reuse_tau is not None:
            return f"oval reuse τ={self.reuse_tau:g}"
        if self.name == "oval" and self.group_pages:
            return f"oval groups of {self.group_pages}"
        return f"oval eta={self.eta:g}" if self.name == "oval" else self.name

    @property
    def scorer(self) -> str:
        """Which page scorer the row's scores come from (window policies select oval pages; 'oval:G' for two-level
        oval scoring with groups of G pages)."""
        if self.group_pages:
            return f"oval:{self.group_pages}"
        return "oval" if self.name in WINDOW_POLICIES else self.name

    def config(self, base: OvalConfig) -> OvalConfig:
        """The OvalConfig this row decodes with (dense rows ignore it beyond page_size)."""
        if self.name == "dense":
            return base
        if self.name == "window":
            # Give the window exactly the slots the selected pages would have had: same T as the scored rows.
            extra = self.top_k * base.page_size + max(base.window_max, base.page_size) - base.window_max
            return base.replace(top_k=0, window_min=base.window_min + extra, window_max=base.window_max + extra)
        scorer = "quest" if self.name == "quest" else "oval"
        if self.name in WINDOW_POLICIES:
            lo, hi = self.window
            return base.replace(top_k=self.top_k, scorer=scorer, eta=self.eta, window_min=lo, window_max=hi)
        return base.replace(top_k=self.top_k, scorer=scorer, eta=self.eta if self.eta is not None else base.eta)

    def tokens_per_step(self, base: OvalConfig) -> int | None:
        """K/V slots read per KV head in a sparse layer (None for dense: everything)."""
        return None if self.name == "dense" else slots_per_step(self.config(base))

    def group_key(self) -> tuple:
        """Rows with the same key decode with one OvalConfig in one call (scored rows differ only in scores)."""
        if self.name in SCORED:
            return ("scored", self.top_k)
        return (self.name, self.top_k, self.window)

    def summary_eta(self) -> float | None:
        """The eta to seal this row's pages with; None = its rows never read an oval summary (quest only)."""
        return self.eta if self.name in OVAL_PAGES else None


def build_policies(names: list[str], top_ks: list[int], etas: list[float],
                   windows: dict[str, tuple[int, int]] | None = None,
                   reuse_taus: Sequence[float] = (), group_pages: Sequence[int] = ()) -> list[Policy]:
    """Rows of one pass: dense first (the reference), then every other policy at every budget. Window policies
    take the first eta and their range from `windows` (policy name -> (lo, hi)); each of `reuse_taus` adds an oval
    row (first eta) that reuses selections at that tau, and each of `group_pages` one that scores in two levels
    with groups of that many pages, right after the oval rows."""
    unknown = [n for n in names if n not in ALL_POLICIES]
    if unknown:
        raise ValueError(f"--policies names unknown policy {unknown}; allowed: {', '.join(ALL_POLICIES)}")
    windows = windows or {}
    missing = [n for n in names if n in WINDOW_POLICIES and n not in windows]
    if missing:
        raise ValueError(f"policy {missing} needs a window range (--{missing[0]}-window LO,HI)")
    rows = [Policy("dense")]
    for k in top_ks:
        for name in ALL_POLICIES[1:]:
            if name not in names:
                continue
            if name == "oval":
                rows.extend(Policy("oval", k, float(eta)) for eta in etas)
                rows.extend(Policy("oval", k, float(etas[0]), reuse_tau=float(tau)) for tau in reuse_taus)
                rows.extend(Policy("oval", k, float(etas[0]), group_pages=int(g)) for g in group_pages)
            elif name in WINDOW_POLICIES:
                rows.append(Policy(name, k, float(etas[0]), tuple(windows[name])))
            else:
                rows.append(Policy(name, k))
    return rows


def parse_int_list(text: str, option: str, low: int, high: int) -> list[int]:
    return _parse_list(text, option, low, high, int, "integers, e.g. 2,4,8")


def parse_float_list(text: str, option: str, low: float, high: float) -> list[float]:
    return _parse_list(text, option, low, high, float, "numbers, e.g. 0,0.5")


def _parse_list(text: str, option: str, low, high, kind, example: str) -> list:
    """Comma-separated values of `kind` within [low, high], duplicates dropped in order; errors name the option."""
    try:
        values = [kind(part) for part in str(text).split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"{option}={text!r} must be comma-separated {example}") from exc
    if not values:
        raise ValueError(f"{option}={text!r} names no value")
    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise ValueError(f"{option}={text!r}: {bad} out of range; allowed [{low}, {high}]")
    return list(dict.fromkeys(values))


def parse_names(text: str, option: str, allowed: tuple[str, ...]) -> list[str]:
    names = [part.strip() for part in str(text).split(",") if part.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{option}={text!r}: unknown {bad or 'empty list'}; allowed: {', '.join(allowed)}")
    return names
