"""`oval-edge plan`: will this model fit on this board, with what context, and how fast could it decode?

Reads the model's configuration only (config.json or GGUF metadata), sizes the page pool for each page size with
`oval_edge.pool_sizing.size_pool`, and optionally writes the TOML that `oval-edge serve --config` reads.
Exit status: 0 when the requested context fits (or for `--device all`), 1 when it does not fit, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os

from oval_edge.config import DEFAULT_PREFILL_CHUNK, KV_DTYPES, OvalConfig
from oval_edge.geometry import RECORD_FORMATS
from oval_edge.jetson.modules import ORIN_MODULES, ModuleSpec, get_module, module_names
from oval_edge.runtime.model.origin.source import quant_choices
from oval_edge.units import parse_bytes

from .catalog import known_model, known_names
from .compute import DEFAULT_SPEED_TOLERANCE, DevicePlan, PlanRequest, plan_device
from .model import ModelShape, read_model_shape
from .models_table import USEFUL_CONTEXT, models_caption, models_table
from .report import format_all_table, format_device_plan, report_json


DEFAULT_CONTEXT = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto",
                        help=f"auto (probe this machine), all (every Orin module), or one of: {', '.join(module_names())}")
    parser.add_argument("--model", default="default",
                        help="a .gguf file, a config.json, a Hugging Face folder, 'default' (bundled SmolLM2-135M), "
                             f"or a model plan knows by name: {', '.join(known_names())}")
    parser.add_argument("--quant", default="auto", choices=quant_choices("auto"), help="weight quantization")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence to plan for (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--memory-budget", default=None,
                        help="bytes the server may use, e.g. 6GiB (default: the device's DRAM minus the OS reserve)")
    parser.add_argument("--page-size", default="16,32,64,128", help="comma-separated page sizes to compare")
    parser.add_argument("--top-k", type=int, default=OvalConfig.top_k, help="pages selected per KV head per step")
    parser.add_argument("--kv-dtype", default=OvalConfig.kv_dtype, choices=KV_DTYPES,
                        help="K/V page storage: auto (bfloat16 on CPU, the activations' dtype on CUDA), float32, "
                             "bfloat16, float16, or int8 (codes + an fp32 scale per token and KV head)")
    parser.add_argument("--record", default=OvalConfig.record, choices=RECORD_FORMATS,
                        help="how oval page records (the per-page summaries) are stored: float (the KV dtype), int8 "
                             "or int4 codes with per-page scales; with --kv-dtype int8, int8 records keep the "
                             "pages' capacity gain (default float)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help=f"prefill chunk in tokens (default {DEFAULT_PREFILL_CHUNK})")
    parser.add_argument("--desktop", action="store_true", help="reserve memory for the desktop (default: headless)")
    parser.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (overrides the table)")
    parser.add_argument("--speed-tolerance", type=float, default=DEFAULT_SPEED_TOLERANCE,
                        help="page sizes whose predicted step is within this fraction of the fastest tie, and the "
                             "one attending the most K/V tokens is recommended (default "
                             f"{DEFAULT_SPEED_TOLERANCE:g}, i.e. {DEFAULT_SPEED_TOLERANCE * 100:g}%%)")
    parser.add_argument("--runtime-overhead", default=None,
                        help="resident bytes of the loaded server besides its weights (default: 650MiB CPU, 800MiB CUDA)")
    parser.add_argument("--root", default="/", help="read /proc and /etc under this folder (recorded files)")
    parser.add_argument("--verbose", action="store_true",
                        help="every column, and the source of each step-cost figure (docs/step-cost.md cites them)")
    parser.add_argument("--models", action="store_true",
                        help="instead of one model: the longest context each known model holds on each Orin module "
                             f"(--device all or auto) or on --device NAME, as a Markdown table; '-' under --context "
                             f"when given, else {USEFUL_CONTEXT}")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the full plan as JSON here")
    parser.add_argument("--write-config", default=None, help="write the recommended configuration as TOML here")


def _page_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(p) for p in str(text).split(",") if p.strip())
    except ValueError as exc:
        raise ValueError(f"--page-size={text!r} must be comma-separated integers, e.g. 16,32,64,128") from exc
    if not sizes:
        raise ValueError(f"--page-size={text!r} names no page size; e.g. 16,32,64,128")
    return sizes


def build_request(args: argparse.Namespace) -> PlanRequest:
    oval = OvalConfig(top_k=args.top_k, kv_dtype=args.kv_dtype, record=args.record)
    return PlanRequest(
        quant=args.quant, context=DEFAULT_CONTEXT if args.context is None else args.context, batch=args.batch,
        page_sizes=_page_sizes(args.page_size),
        oval=oval,
        memory_budget=parse_bytes(args.memory_budget, "--memory-budget") if args.memory_budget else None,
        desktop=args.desktop,
        runtime_overhead=parse_bytes(args.runtime_overhead, "--runtime-overhead") if args.runtime_overhead else None,
        prefill_chunk=args.prefill_chunk, bandwidth_gbps=args.bandwidth, speed_tolerance=args.speed_tolerance,
    )


def _auto_device(root: str) -> tuple[ModuleSpec, int | None, str, str]:
    """(spec, budget now, where the budget comes from, probe report) for this machine."""
    from oval_edge.jetson.probe import probe  # torch only inside, and only when this is not a Jetson

    found = probe(root)
    spec = found.module
    if spec is None:  # a Jetson the table does not know: plan with what the kernel reports
        total = found.meminfo.total if found.meminfo else 0
        spec = ModuleSpec("jetson", found.title, "jetson", total, None, "unknown module: pass --bandwidth",
                          None, None, None)
    return spec, found.budget_bytes, found.budget_source, found.describe()


def planned_shape(model: str | None) -> ModelShape:
    """A path (read_model_shape), or else a model plan knows by name (catalog.py)."""
    if model not in (None, "", "default") and not os.path.exists(os.path.expanduser(model)):
        known = known_model(model)
        if known is not None:
            return known.shape()
        raise ValueError(f"model path {os.path.abspath(os.path.expanduser(model))} does not exist and plan knows no "
                         f"model named {model!r}; pass a .gguf file, a config.json, a Hugging Face model folder, "
                         f"'default', or one of: {', '.join(known_names())}")
    return read_model_shape(model)


def run(args: argparse.Namespace) -> int:
    device = str(args.device).strip().lower()
    if args.models:
        modules = ORIN_MODULES if device in ("all", "auto") else (get_module(device, args.root),)
        if args.model not in (None, "", "default") or args.write_config:
            raise ValueError("--models plans every known model; leave out --model and --write-config")
        floor = USEFUL_CONTEXT if args.context is None else args.context
        request = build_request(args)
        print(models_caption(request, floor) + "\n\n" + models_table(request, floor, modules))
        return 0
    request = build_request(args)
    shape = planned_shape(args.model)
    if device == "all":
        if args.write_config:
            raise ValueError("--write-config needs one device; use --device NAME or --device auto")
        plans = [plan_device(shape, m, request) for m in ORIN_MODULES]
        print(format_all_table(plans, args.verbose))
        _write_json(args.json_path, plans)
        return 0
    if device == "auto":
        spec, budget, source, report = _auto_device(args.root)
        print(report + "\n")
        plan = plan_device(shape, spec, request, budget, source)
    else:
        plan = plan_device(shape, get_module(device, args.root), request)
    print(format_device_plan(plan, args.verbose))
    _write_json(args.json_path, [plan])
    if args.write_config:
        if not plan.fits:
            raise ValueError(f"not writing {args.write_config}: {plan.does_not_fit_message()}")
        print(f"wrote {write_plan_config(args.write_config, plan, args.model)}")
    return 0 if plan.fits else 1


def _write_json(path: str | None, plans: list[DevicePlan]) -> None:
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(report_json(plans), handle, indent=2)
    except OSError as exc:
        raise ValueError(f"cannot write --json {path}: {exc.strerror or exc}") from exc


def config_sections(plan: DevicePlan, model_arg: str | None) -> dict:
    """The TOML sections for the recommended row (schema: runtime/config_file.py).

    memory_budget is what serve sizes its pool from (PagePlan.serve_memory_budget): the planned budget, less
    what serve's own accounting leaves out - on CUDA it counts only torch's allocator, not the CUDA context or the
    host process (the runtime overhead); everywhere its workspace formula omits the page-sealing transient - so
    that serve allocates the planned pages and the process stays inside the planned budget.
    """
    best = plan.recommended
    assert best is not None
    r = plan.request
    model_path = "default" if model_arg in (None, "", "default") else os.path.abspath(plan.shape.path)
    if plan.shape.source == "config.json" and model_path != "default":
        model_path = os.path.dirname(model_path)  # serve loads the folder the config.json describes
    cpu = plan.device.kind == "cpu"
    plan_info = {
        "device": plan.device.name, "model": plan.shape.name, "weight_bytes": plan.weights.total,
        "workspace_bytes": best.workspace_bytes, "transient_bytes": best.transient_bytes, "pages": best.pages,
        "pool_bytes": best.pool_bytes, "runtime_overhead_bytes": plan.runtime_overhead,
        "predicted_peak_bytes": best.predicted_peak_bytes,
        "predicted_serving_peak_bytes": best.predicted_serving_peak_bytes, "load_peak_bytes": plan.load_peak_bytes,
        "budget_bytes": plan.budget_bytes, "budget_source": plan.budget_source,
    }
    if best.roofline_tok_s is not None:
        plan_info["decode_tok_s_roofline"] = round(best.roofline_tok_s, 2)
    if best.decode_tok_s is not None:  # bytes / bandwidth + the fixed cost of the served path (step_cost.py)
        plan_info["decode_tok_s_predicted"] = round(best.decode_tok_s, 2)
        plan_info["decode_path"] = best.step_cost["served"]
    return {
        "model": {"path": model_path, "quant": r.quant},
        "oval": r.oval.replace(page_size=best.page_size).to_dict(),
        "server": {"memory_budget": best.serve_memory_budget, "max_batch": r.batch, "max_model_len": r.context,
                   "prefill_chunk": r.prefill_chunk, "device": "cpu" if cpu else "cuda"},
        "plan": plan_info,
    }


def write_plan_config(path: str, plan: DevicePlan, model_arg: str | None) -> str:
    from oval_edge.runtime.config_file import write_config_file

    return write_config_file(path, config_sections(plan, model_arg))
