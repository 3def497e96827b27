"""The decode policies `oval-edge eval` compares, and how each one maps onto the runtime's OvalConfig.

Every policy except `dense` reads the same number of K/V slots per KV head at a sparse decode step,
T = (sink_pages + top_k) * page_size + max(window, page_size), so they are compared at equal budget:

    dense    every cached token (attention="dense"): the reference the others are measured against
    window   sink pages + one longer local window of T - sink tokens; nothing from the middle
    quest    sink + top-k pages by Quest's per-channel min/max bound + window
    oval     sink + top-k pages by the output-aware local basis (built at seal time with this row's eta) + window
    oracle   sink + top-k pages by their true attention mass (dense logits over every cached key) + window;
             the reference ceiling, the only policy allowed to read all keys
"""

from __future__ import annotations

from dataclasses import dataclass

from oval_edge.config import OvalConfig
from oval_edge.selection import slots_per_step

POLICY_NAMES = ("dense", "window", "quest", "oval", "oracle")
SCORED = ("quest", "oval", "oracle")  # policies that pick top-k pages with a page scorer


@dataclass(frozen=True)
class Policy:
    name: str
    top_k: int | None = None  # None for dense
    eta: float | None = None  # oval only: the output-aware mix its page summaries are built with

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"policy {self.name!r} is unknown; allowed: {', '.join(POLICY_NAMES)}")
        if (self.name == "dense") != (self.top_k is None):
            raise ValueError(f"policy {self.name!r}: top_k must be None for dense and an integer otherwise")
        if (self.name == "oval") != (self.eta is not None):
            raise ValueError(f"policy {self.name!r}: eta is set for oval rows only")

    @property
    def label(self) -> str:
        if self.name == "dense":
            return "dense"
        if self.name == "oval":
            return f"oval eta={self.eta:g} k={self.top_k}"
        return f"{self.name} k={self.top_k}"

    @property
    def family(self) -> str:
        """One plotted line per family: the policy, with its eta for oval."""
        return f"oval eta={self.eta:g}" if self.name == "oval" else self.name

    def config(self, base: OvalConfig) -> OvalConfig:
        """The OvalConfig this row decodes with (dense rows ignore it beyond page_size)."""
        if self.name == "dense":
            return base
        if self.name == "window":
            # Give the window exactly the slots the selected pages would have had: same T as the scored rows.
            extra = self.top_k * base.page_size + max(base.window_max, base.page_size) - base.window_max
            return base.replace(top_k=0, window_min=base.window_min + extra, window_max=base.window_max + extra)
        scorer = "quest" if self.name == "quest" else "oval"
        return base.replace(top_k=self.top_k, scorer=scorer, eta=self.eta if self.eta is not None else base.eta)

    def tokens_per_step(self, base: OvalConfig) -> int | None:
        """K/V slots read per KV head in a sparse layer (None for dense: everything)."""
        return None if self.name == "dense" else slots_per_step(self.config(base))

    def group_key(self) -> tuple:
        """Rows with the same key decode with one OvalConfig in one call (scored rows differ only in scores)."""
        if self.name in SCORED:
            return ("scored", self.top_k)
        return (self.name, self.top_k)

    def summary_eta(self) -> float | None:
        """The eta to seal this row's pages with; None = its rows never read an oval summary (quest only)."""
        return self.eta if self.name == "oval" else None


def build_policies(names: list[str], top_ks: list[int], etas: list[float]) -> list[Policy]:
    """Rows of one pass: dense first (the reference), then every other policy at every budget."""
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"--policies names unknown policy {unknown}; allowed: {', '.join(POLICY_NAMES)}")
    rows = [Policy("dense")]
    for k in top_ks:
        for name in POLICY_NAMES[1:]:
            if name not in names:
                continue
            if name == "oval":
                rows.extend(Policy("oval", k, float(eta)) for eta in etas)
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
