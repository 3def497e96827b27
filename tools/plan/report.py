"""Text tables and JSON for `oval-edge plan`. The default text fits 120 columns; `--verbose` adds the columns and
the figures' sources (docs/step-cost.md cites them too), `--json` holds everything."""

from __future__ import annotations

import textwrap
from dataclasses import asdict

from oval_edge.units import format_bytes

from .answer import answer_line, answer_of, best_row, what_fits_line
from .compute import FORMULA, DevicePlan, PlanChoice, predicted_step_s, state_snapshots
from .memory import PagePlan, geometry_for
from .step_cost import GRAPHED


def _tok_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return format_bytes(lo) if lo == hi else f"{format_bytes(lo)}..{format_bytes(hi)}"


COLUMNS = 120


def _wrap(lines: list[str]) -> list[str]:
    """Prose lines folded to COLUMNS, continuation lines indented past the 'label    : ' column."""
    out = []
    for line in lines:
        out.extend(textwrap.wrap(line, COLUMNS, subsequent_indent=" " * 11, break_on_hyphens=False) or [""])
    return out


def _pick(header: list[str], rows: list[list[str]], keep: list[bool]) -> tuple[list[str], list[list[str]]]:
    return [h for h, k in zip(header, keep) if k], [[c for c, k in zip(r, keep) if k] for r in rows]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def device_line(plan: DevicePlan) -> str:
    d = plan.device
    bw = f"{d.bandwidth_gbps:g} GB/s" if d.bandwidth_gbps else "bandwidth unknown"
    gpu = f", {d.gpu_sms} SMs {d.arch}" if d.gpu_sms else ""
    modes = ", power modes " + " ".join(f"{m.id}:{m.name}" for m in d.power_modes) if d.power_modes else ""
    return f"{d.title}: {format_bytes(d.dram_bytes)}, {bw} ({d.bandwidth_note}){gpu}{modes}"


def format_device_plan(plan: DevicePlan, verbose: bool = False) -> str:
    s, r, w = plan.shape, plan.request, plan.weights
    geo = geometry_for(s, r.oval.replace(page_size=plan.rows[0].page_size), w.target)
    lines = [
        f"model    : {s.describe()}",
        f"device   : {device_line(plan)}",
        f"budget   : {format_bytes(plan.budget_bytes)} ({plan.budget_source})",
        f"weights  : {format_bytes(w.total)} {r.quant} ({w.layout} layout on {w.target}): "
        f"{'codes' if w.layout == 'grouped' else '4-bit codes'} {format_bytes(w.linear_codes)} + "
        f"{'scales and mins' if w.layout == 'grouped' else 'quant state'} {format_bytes(w.quant_state)}"
        + (f" + dense projections {format_bytes(w.dense_linear)}" if w.dense_linear else "")
        + f", embedding {format_bytes(w.embedding)}, lm_head "
        + ("tied (0 B)" if w.lm_head == 0 else format_bytes(w.lm_head))
        + f", norms {format_bytes(w.norms)}" + (f", biases {format_bytes(w.biases)}" if w.biases else "")
        + (f", per-layer input table {format_bytes(w.per_layer_table)} ([{s.per_layer_vocab}, {s.layers} x "
           f"{s.per_layer_input}], looked up, not read per step)" if w.per_layer_table else ""),
        f"KV       : {format_bytes(geo.kv_bytes_per_token)} per token ({geo.kv_label}, "
        f"{'all' if geo.paged_layers == s.layers else f'the {geo.paged_layers} full'} layers) + "
        f"{r.oval.scorer} "
        f"summaries (rank {r.oval.rank}) {format_bytes(geo.summary_bytes_per_page)} per page of {geo.page_size}; "
        f"top_k {r.oval.top_k}, sink {r.oval.sink_pages}, window {r.oval.window_max}, "
        f"dense layers {r.oval.dense_layers}"
        + (f"; {len(geo.ring_layers)} sliding layers keep a ring of ceil(({s.sliding_window} - 1) / page) + 1 "
           f"pages of K/V per sequence ({_span([p.ring_bytes for p in plan.rows])} for batch {r.batch}), beside "
           "the pool" if geo.ring_layers else "")
        + (f"; the last {len(geo.shared)} layers keep no K/V (they read the pages or ring of layers "
           f"{', '.join(str(n) for n in sorted(set(dict(geo.shared).values())))})" if geo.shared else "")
        + (f"; {len(geo.state_layers)} state layers keep {format_bytes(geo.state_bytes_per_sequence)} per sequence "
           f"(x batch {r.batch} + {state_snapshots(geo, r)} prefix-cache snapshots = "
           f"{format_bytes((r.batch + state_snapshots(geo, r)) * geo.state_bytes_per_sequence)}), beside the pool"
           if geo.states is not None else ""),
        f"process  : runtime overhead {format_bytes(plan.runtime_overhead)}; loading peaks at "
        f"{format_bytes(plan.load_peak_bytes)}",
        f"request  : context {r.context} x batch {r.batch}, prefill chunk {r.prefill_chunk}",
        f"workspace: per page size, serve's formula reserves {_span([p.serve_workspace_bytes for p in plan.rows])}; "
        f"the largest step needs {_span([p.transient_bytes for p in plan.rows])}, of which sealing pages "
        f"(a few pages x {geo.paged_layers} layers x {s.kv_heads} heads at once, bounded by bytes) "
        f"{_span([p.seal_bytes for p in plan.rows])}; the plan sets aside the larger",
        "",
    ]
    if plan.load_exceeds_budget:
        lines.insert(-1, f"warning  : the first start (decoder_build.py quantizes one layer at a time) peaks at "
                         f"{format_bytes(plan.load_peak_bytes)}, above the budget: it may swap or be OOM-killed; "
                         "later starts map the weight cache and quantize nothing")
    if s.max_context and r.context > s.max_context:
        lines.insert(-1, f"warning  : context {r.context} exceeds the model's trained context {s.max_context}")
    lines = _wrap(lines)
    lines.append(_table(*_page_table(plan, verbose)))
    lines.append(f"  * the path serve runs here. tok/s: whole batch of {r.batch}; see 'decode' below")
    lines.append("")
    lines.extend(_wrap(decode_lines(plan, verbose)))
    lines.append("")
    if plan.recommended is not None:
        p = plan.recommended
        tail = [f"recommendation: page_size {p.page_size} -> {p.pages} pages, predicted decode "
                f"{_tok_s(p.decode_tok_s)} tok/s ({p.step_cost['served']}; roofline {_tok_s(p.roofline_tok_s)}), "
                f"predicted peak {format_bytes(p.predicted_peak_bytes)}"]
        if plan.choice is not None:
            tail.append(f"  why: {choice_text(plan.choice)}")
        tail.append(f"  {p.explain}")
    else:
        tail = [plan.does_not_fit_message(), what_fits_line(plan) or ""]
    tail.append(answer_line(answer_of(plan)))
    if plan.bandwidth_gbps is None:
        tail.append("note: decode tok/s needs the memory bandwidth; pass --bandwidth GB/s to get the prediction")
    return "\n".join(lines + _wrap(tail))


def _page_table(plan: DevicePlan, verbose: bool) -> tuple[list[str], list[list[str]]]:
    """One row per page size; without `verbose` the columns a reader compares (120 columns wide)."""
    r = plan.request
    paths = [(p["path"], p["served"]) for p in plan.rows[0].step_cost["paths"]]
    header = ["page", "pages", "pool", "tokens", "max ctx/seq", f"fits {r.context}x{r.batch}", "read tok/step",
              "K/V read/step", "summaries read/step", "bytes/step", "roofline tok/s"] \
        + [f"{name} tok/s" + ("*" if served else "") for name, served in paths] \
        + ["workspace", "transient", "peak"]
    keep = [True, True, True, verbose, True, True, True, verbose, verbose, True, True] \
        + [verbose or served for _, served in paths] + [verbose, verbose, True]
    rows = [[str(p.page_size), str(p.pages), format_bytes(p.pool_bytes), str(p.tokens_in_pool),
             str(p.max_context_per_sequence), "yes" if p.fits else "no", str(p.tokens_read_per_step),
             format_bytes(p.kv_bytes_read_per_step), format_bytes(p.summary_bytes_read_per_step),
             format_bytes(p.bytes_per_step),
             _tok_s(p.roofline_tok_s)] + [_tok_s(path["tok_s"]) for path in p.step_cost["paths"]]
            + [format_bytes(p.workspace_bytes), format_bytes(p.transient_bytes), format_bytes(p.predicted_peak_bytes)]
            for p in plan.rows]
    return _pick(header, rows, keep)


def _served(plan: DevicePlan) -> list[bool]:
    return [p["served"] for p in plan.rows[0].step_cost["paths"]]


def decode_lines(plan: DevicePlan, verbose: bool = False) -> list[str]:
    """How decode tok/s is predicted: the formula, the op count, each path's fixed cost and every figure's kind
    (measured or estimate); with `verbose` each figure's source too (else docs/step-cost.md names them)."""
    c, ops, s = plan.step_cost, plan.op_count, plan.shape
    row = plan.recommended or plan.rows[0]
    dense = min(plan.request.oval.dense_layers, s.layers)
    count = ops.ops(s.layers, dense)
    lines = [f"decode   : {FORMULA}",
             f"  ops per step {count} = {ops.base.value:g} + {ops.per_dense_layer.value:g} x {dense} dense + "
             f"{ops.per_sparse_layer.value:g} x {s.layers - dense} sparse layers ({ops.quant} count, "
             f"{ops.base.kind}{'' if ops.quant == plan.request.quant else f'; {plan.request.quant} taken as nf4'})",
             f"  serve runs the {c.served} step on {c.kind} (CUDA graphs on CUDA, the static step eager on a CPU); "
             f"host figures for {c.host}"]
    for path in row.step_cost["paths"]:
        parts = " + ".join(f"{name} {ms:.3g} ms" for name, ms in path["fixed_parts_ms"].items())
        mark = " (served)" if path["served"] else ""
        lines.append(f"  {path['path']}{mark}: fixed {path['fixed_ms']:.3g} ms per step = {parts}"
                     + (f"; bytes/bw {path['bytes_ms']:.3g} ms -> {_tok_s(path['tok_s'])} tok/s at page "
                        f"{row.page_size}" if path["bytes_ms"] is not None else ""))
    named = [("op_host", c.op_host_us), ("step_host", c.step_host_us), ("graph_launch", c.graph_launch_us),
             ("node_gpu", c.node_gpu_us), ("ops/layer", ops.per_sparse_layer)]
    lines.append("  figures: " + "; ".join(f"{name} {f.label()}" for name, f in named if f is not None)
                 + ("" if verbose else "; their sources: docs/step-cost.md or --verbose"))
    for name, f in named:
        if f is not None and verbose:
            lines.append(f"    {name}: {f.source}")
    if c.served == GRAPHED:
        lines.append("  the kernel count on CUDA is taken as the CPU step's op count (estimate; `make gpu-check` "
                     "counts launches)")
    return lines


def choice_text(choice: PlanChoice) -> str:
    """Issue #26's rule in plan: the speed tie, the quality proxy, the runner-up and what was traded."""
    c, f = choice.chosen, choice.fastest

    def step(row: PagePlan) -> str:
        t = predicted_step_s(row)
        return f"{t * 1e3:.2f} ms" if t is not None and choice.by == "predicted step" else \
            f"{format_bytes(row.bytes_per_step)} per step"

    tied = ", ".join(str(r.page_size) for r in sorted(choice.tied, key=lambda r: r.page_size))
    text = (f"page size(s) {tied} are within {choice.tolerance:.0%} of the fastest {choice.by} (page {f.page_size}, "
            f"{step(f)}); of them page {c.page_size} attends the most K/V tokens per step ({c.tokens_read_per_step}: "
            "plan's quality proxy, since it cannot measure KL; `oval-edge profile` does)")
    other = choice.runner_up
    if other is not None:
        key = predicted_step_s if choice.by == "predicted step" else (lambda r: float(r.bytes_per_step))
        dt = key(c) / key(other) - 1
        speed = f"gives up {dt:.1%} of speed" if dt > 0 else f"is {-dt:.1%} faster"
        where = "tied" if other in choice.tied else "outside the tie"
        text += (f". Runner-up: page {other.page_size} ({where}, {step(other)}, {other.tokens_read_per_step} "
                 f"tokens): this choice {speed} for {c.tokens_read_per_step / max(other.tokens_read_per_step, 1):.2f}x "
                 "the tokens attended")
    return text


def format_all_table(plans: list[DevicePlan], verbose: bool = False) -> str:
    """One row per module from `answer_of` (the page size, pages, fits and longest context `--device NAME` and the
    JSON give), then one line for each module that cannot hold the request saying what it holds."""
    r = plans[0].request
    header = ["device", "DRAM", "GB/s", "budget", "weights", "page", "pages", "longest ctx",
              f"fits {r.context}x{r.batch}", "roofline tok/s", "decode tok/s", "path", "serve peak", "load peak",
              "min budget"]
    keep = [True, verbose, verbose, True, True, True, True, True, True, verbose, True, verbose, True, verbose,
            verbose]
    rows = []
    for plan in plans:
        answer, p = answer_of(plan), best_row(plan)
        bw = f"{plan.bandwidth_gbps:g}" if plan.bandwidth_gbps else "n/a"
        rows.append([plan.device.name, format_bytes(plan.device.dram_bytes), bw, format_bytes(plan.budget_bytes),
                     format_bytes(plan.weights.total), str(answer.page_size), str(answer.pages),
                     str(answer.longest_context), "yes" if answer.fits else "no", _tok_s(p.roofline_tok_s),
                     _tok_s(p.decode_tok_s), p.step_cost["served"],
                     format_bytes(p.predicted_serving_peak_bytes),
                     format_bytes(plan.load_peak_bytes) + (" (!)" if plan.load_exceeds_budget else ""),
                     format_bytes(min(row.minimum_budget for row in plan.rows))])
    s = plans[0].shape
    lines = [f"{s.name} ({r.quant}), {r.context} tokens x batch {r.batch}, {'desktop' if r.desktop else 'headless'}; "
             "longest ctx: the most tokens a sequence can hold",
             _table(*_pick(header, rows, keep))]
    lines += [line for line in map(what_fits_line, plans) if line]
    lines.append("decode tok/s: the path serve runs; `--device NAME` shows how it is predicted"
                 + ("" if verbose else "; --verbose adds columns"))
    if verbose and any(plan.load_exceeds_budget for plan in plans):
        lines.append("(!) the first start (quantizing one layer at a time) needs more than the budget on this "
                     "module; later starts map the weight cache")
    return "\n".join(_wrap(lines[:1]) + [lines[1]] + _wrap(lines[2:]))


def plan_json(plan: DevicePlan) -> dict:
    d = plan.device
    best = best_row(plan)
    return {
        "device": {"name": d.name, "title": d.title, "kind": d.kind, "dram_bytes": d.dram_bytes,
                   "bandwidth_gbps": plan.bandwidth_gbps, "bandwidth_note": d.bandwidth_note,
                   "gpu_sms": d.gpu_sms, "arch": d.arch,
                   "power_modes": [asdict(m) for m in d.power_modes], "reserve_note": d.reserve_note},
        "budget_bytes": plan.budget_bytes,
        "budget_source": plan.budget_source,
        "weights": plan.weights.as_dict(),
        "weight_bytes": plan.weights.total,
        "runtime_overhead_bytes": plan.runtime_overhead,
        "load_peak_bytes": plan.load_peak_bytes,
        "page_sizes": [p.as_dict() for p in plan.rows],
        "recommended": plan.recommended.as_dict() if plan.recommended else None,
        "recommendation_rule": _choice_json(plan.choice),
        "step_cost": {"formula": FORMULA, "served": plan.step_cost.served, "host": plan.step_cost.host,
                      "figures": plan.step_cost.figures(),
                      "ops": {"quant": plan.op_count.quant, "base": plan.op_count.base.as_dict(),
                              "per_dense_layer": plan.op_count.per_dense_layer.as_dict(),
                              "per_sparse_layer": plan.op_count.per_sparse_layer.as_dict()}},
        "answer": answer_of(plan).as_dict(),  # what the text and the --device all table print
        "fits": plan.fits,
        "longest_context": plan.longest_context[0],
        "longest_context_page_size": plan.longest_context[1],
        # The number to compare with a measured serve peak: the recommended row's, else the largest pool's.
        "predicted_peak_bytes": best.predicted_peak_bytes,
        "predicted_serving_peak_bytes": best.predicted_serving_peak_bytes,
        "message": None if plan.fits else plan.does_not_fit_message(),
        "what_fits": what_fits_line(plan),
    }


def report_json(plans: list[DevicePlan]) -> dict:
    r = plans[0].request
    out = {
        "model": asdict(plans[0].shape),
        "request": {"quant": r.quant, "context": r.context, "batch": r.batch, "page_sizes": list(r.page_sizes),
                    "prefill_chunk": r.prefill_chunk, "desktop": r.desktop, "oval": r.oval.to_dict()},
        "devices": [plan_json(p) for p in plans],
    }
    if len(plans) == 1:
        out["predicted_peak_bytes"] = out["devices"][0]["predicted_peak_bytes"]
    return out


def _choice_json(choice: PlanChoice | None) -> dict | None:
    if choice is None:
        return None
    return {"rule": "within the speed tolerance of the fastest, the most K/V tokens attended per step (quality "
                    "proxy), then the smaller page, then the longest context",
            "ranked_by": choice.by, "speed_tolerance": choice.tolerance, "fastest_page_size": choice.fastest.page_size,
            "tied_page_sizes": [r.page_size for r in choice.tied],
            "runner_up_page_size": choice.runner_up.page_size if choice.runner_up else None,
            "explanation": choice_text(choice)}
