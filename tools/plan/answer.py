"""The one answer plan gives for a model on a device: whether the requested context fits, on which page size with
how many pages, and the longest context a sequence can hold. `plan --device NAME` prints it, `--json` writes it and
`plan --device all` tabulates it, all from `answer_of`, so the three cannot disagree. A device that cannot hold the
request also says, in one line, what it does hold (`what_fits_line`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from oval_edge.jetson.modules import ModuleSpec

from .catalog import KNOWN_MODELS
from .compute import DevicePlan, PlanRequest, plan_device
from .memory import PagePlan


@dataclass(frozen=True)
class FitAnswer:
    device: str
    context: int  # the requested tokens per sequence
    batch: int
    fits: bool  # `batch` sequences of `context` tokens fit the pool at `page_size`
    page_size: int  # the recommended page size, or (nothing fits) the one holding the longest context
    pages: int  # the pool serve builds at that page size when started for `context`
    longest_context: int  # the most tokens a sequence can hold at `batch` on any planned page size
    longest_page_size: int

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def best_row(plan: DevicePlan) -> PagePlan:
    """The page size the answer speaks for: the recommended one, else the one holding the longest context."""
    if plan.recommended is not None:
        return plan.recommended
    return next(r for r in plan.rows if r.page_size == plan.longest_context[1])


def answer_of(plan: DevicePlan) -> FitAnswer:
    row = best_row(plan)
    tokens, page = plan.longest_context
    return FitAnswer(plan.device.name, plan.request.context, plan.request.batch, plan.fits, row.page_size,
                     row.pages, tokens, page)


def answer_line(answer: FitAnswer) -> str:
    return (f"answer: fits {answer.context} x {answer.batch}: {'yes' if answer.fits else 'no'}; page_size "
            f"{answer.page_size}, {answer.pages} pages; longest context {answer.longest_context} tokens per sequence "
            f"(page_size {answer.longest_page_size})")


def largest_known_fit(device: ModuleSpec, request: PlanRequest, exclude: str = "") -> DevicePlan | None:
    """The plan of the largest model (by planned weight bytes) of the known list that fits `request` on `device`.
    A GGUF's own blocks ('gguf') are no option for a config, so those requests are planned as the loader's default."""
    request = replace(request, quant="auto") if request.quant == "gguf" else request
    plans = [plan_device(m.shape(), device, request) for m in KNOWN_MODELS if m.name.lower() != exclude.lower()]
    fitting = [p for p in plans if p.fits]
    return max(fitting, key=lambda p: p.weights.total) if fitting else None


def what_fits_line(plan: DevicePlan) -> str | None:
    """One line for a device that cannot hold the request: the longest context of this model it holds, and the
    largest known model that holds the requested context. None when the request fits."""
    if plan.fits:
        return None
    r, (tokens, page) = plan.request, plan.longest_context
    held = f"{plan.shape.name} up to {tokens:,} tokens" if tokens > 0 else f"{plan.shape.name} does not fit at all"
    # the same budget (a probe's, --memory-budget's or the table's) for the other models
    other = largest_known_fit(plan.device, replace(r, memory_budget=plan.budget_bytes), exclude=plan.shape.name)
    instead = (f"no known model fits {r.context:,} tokens x {r.batch}" if other is None else
               f"for {r.context:,} tokens: {other.shape.name} (holds {other.longest_context[0]:,})")
    return f"{plan.device.name}: {held}; {instead}"
