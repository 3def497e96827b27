"""Which known model fits which Orin module: `oval-edge plan --models` prints this table, README and docs/plan.md
quote it, and tests/test_plan_answer.py checks the quotes against `models_table` - one source for every figure.

Each cell is `answer_of(plan).longest_context` for that model on that module (the number `plan --device NAME`
prints), or '-' where the module holds fewer tokens than the table's floor (8,192 by default: less is no use for
chat with a document or a long conversation).
"""

from __future__ import annotations

from dataclasses import replace

from oval_edge.jetson.modules import ORIN_MODULES, ModuleSpec
from oval_edge.units import format_bytes

from .answer import answer_of
from .catalog import KNOWN_MODELS, KnownModel
from .compute import PlanRequest, plan_device
from .weights import WeightBreakdown

USEFUL_CONTEXT = 8192
COMMAND = "oval-edge plan --models"


def short_title(module: ModuleSpec) -> str:
    """'Jetson Orin Nano 8GB Super (JetPack 6.2 super modes)' -> 'Nano 8GB Super'."""
    return module.title.removeprefix("Jetson ").replace("Orin ", "").split(" (")[0]


def same_memory(modules: tuple[ModuleSpec, ...]) -> tuple[tuple[ModuleSpec, ...], dict[str, list[ModuleSpec]]]:
    """The modules with distinct memory (DRAM and OS reserve: the same budget holds the same tokens), and for each
    kept one the later modules it stands for (the Orin Nano 8GB Super is an Orin Nano 8GB with faster clocks)."""
    kept: list[ModuleSpec] = []
    merged: dict[str, list[ModuleSpec]] = {}
    for module in modules:
        twin = next((k for k in kept if (k.dram_bytes, k.os_reserve(False), k.os_reserve(True), k.kind)
                     == (module.dram_bytes, module.os_reserve(False), module.os_reserve(True), module.kind)), None)
        if twin is None:
            kept.append(module)
        else:
            merged.setdefault(twin.name, []).append(module)
    return tuple(kept), merged


def longest_contexts(request: PlanRequest, modules: tuple[ModuleSpec, ...] = ORIN_MODULES,
                     models: tuple[KnownModel, ...] = KNOWN_MODELS,
                     ) -> list[tuple[KnownModel, WeightBreakdown, list[int]]]:
    """(model, its planned weights on the first module, its longest context per module) for each known model."""
    out = []
    for model in models:
        plans = [plan_device(model.shape(), module, request) for module in modules]
        out.append((model, plans[0].weights, [answer_of(p).longest_context for p in plans]))
    return out


def models_table(request: PlanRequest | None = None, floor: int = USEFUL_CONTEXT,
                 modules: tuple[ModuleSpec, ...] = ORIN_MODULES) -> str:
    """A Markdown table: one row per known model, one column per module, the tokens a sequence can hold."""
    request = replace(request or PlanRequest(), context=floor)
    kept, merged = same_memory(modules)
    found = sorted(longest_contexts(request, kept), key=lambda f: f[1].total)
    header = ["model", f"{found[0][1].quant} weights"] + [
        short_title(m) + "".join(f" / {short_title(o).removeprefix(short_title(m)).strip()}" for o in
                                 merged.get(m.name, [])) for m in kept]
    rows = [[model.name, format_bytes(weights.total)] + [f"{t:,}" if t >= floor else "-" for t in tokens]
            for model, weights, tokens in found]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule] + [line(r) for r in rows])


def models_caption(request: PlanRequest | None = None, floor: int = USEFUL_CONTEXT) -> str:
    request = request or PlanRequest()
    return (f"Longest context per sequence in tokens, batch {request.batch}, "
            f"{'desktop' if request.desktop else 'headless'}, capped by each model's own; '-': under {floor:,}")
