"""`oval-edge bench`: decode/prefill speed and memory of OVAL vs dense attention in this runtime and vs the peers.

    oval-edge bench --contexts 512,2048,4096,8192 --runs 3 --peers --json bench.json
    oval-edge bench --serve auto --clients 32 --requests-per-client 4 --max-tokens 32
    oval-edge bench --contexts 512,2048 --engines oval --schema tools/data/bench-schema.json   # constrained decoding

Engines: `oval` and `dense` (this runtime, same 4-bit weights and page pool), `hf` (Hugging Face generate(),
dense, weights dequantized from the same GGUF) and `llama.cpp` (llama-cpp-python on the same GGUF file).
Every (engine, context, run) runs in its own child process, engines and contexts alternating run by run; the table
shows medians. With --serve it instead drives concurrent streaming clients against `oval-edge serve`
(see tools/load/command.py). Timing lives here and in `eval`, never in the tests ([R-measuring]).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

from oval_edge.runtime.model.origin.source import quant_choices

from oval_edge.tools.gguf_write.synthetic import DEFAULT_POSITIONS, SYNTHETIC_MODEL

from .report import aggregate, format_table, label_rows, report_json, write_json_report
from .settings import (COUNTED_STEPS, HF_DTYPES, BenchSettings, default_threads, parse_engines, parse_int_list,
                       prompt_length, with_groups, with_reuse, with_schema)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="512,2048,4096,8192",
                        help="comma-separated prompt lengths in tokens (a 'k' suffix = x1024); default 512,2048,4096,8192")
    parser.add_argument("--gen", type=int, default=64, help="tokens generated per run (default 64)")
    parser.add_argument("--runs", type=int, default=3, help="runs per engine and context; the table shows medians")
    parser.add_argument("--engines", default="oval,dense",
                        help="comma-separated: oval, dense, hf, llama.cpp (default oval,dense)")
    parser.add_argument("--peers", action="store_true",
                        help="also run Hugging Face generate() (dense) and llama.cpp (llama-cpp-python) on the same GGUF")
    parser.add_argument("--model", default="default",
                        help="a .gguf file, a Hugging Face folder, 'default' (bundled SmolLM2-135M-Instruct), or "
                             f"'{SYNTHETIC_MODEL}': the bundled model's shape with random weights and "
                             f"{DEFAULT_POSITIONS} positions, written as GGUF once (speed only: its outputs mean nothing)")
    parser.add_argument("--synthetic-positions", type=int, default=None,
                        help=f"positions of --model {SYNTHETIC_MODEL} (default {DEFAULT_POSITIONS})")
    parser.add_argument("--synthetic-seed", type=int, default=None,
                        help=f"seed of --model {SYNTHETIC_MODEL}'s random weights (default 0)")
    parser.add_argument("--quant", default="auto", choices=quant_choices("auto"), help="this runtime's weights")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where every engine runs")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for every engine (default: the CPUs this process may use)")
    parser.add_argument("--page-size", type=int, default=32, help="OVAL page size in tokens (default 32)")
    parser.add_argument("--top-k", type=int, default=4, help="OVAL pages selected per KV head (default 4)")
    parser.add_argument("--oval-from", type=int, default=None, metavar="TOKENS",
                        help="the oval engines attend densely below this context length, as serve does (default: "
                             "serve's default for the device; 0: OVAL at every length)")
    parser.add_argument("--decode-step", default="static", choices=("static", "compiled", "eager"),
                        help="this runtime's decode step: static (default), compiled (torch.compile), eager (the "
                             "shape-following forward)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on CUDA, replay the static step from CUDA graphs (default); --no-cuda-graphs: eager")
    parser.add_argument("--reuse-tau", default=None,
                        help="comma-separated cosines: also run oval with selection reuse at each (oval+reuse@TAU)")
    parser.add_argument("--group-pages", default=None,
                        help="comma-separated group sizes: also run oval scoring in two levels, coarse groups of that "
                             "many pages first (oval+groups@G); 0: flat scoring at every context (oval+groups@0)")
    parser.add_argument("--schema", metavar="FILE.json", default=None,
                        help="also run oval with every token constrained by this JSON schema (xgrammar, as serve's "
                             "response_format does): the oval+schema row, whose decode ratio is the per-token cost "
                             "of constrained decoding. The schema must allow at least --gen + 1 tokens (e.g. an "
                             "array with minItems); tools/data/bench-schema.json does for --gen up to ~300")
    parser.add_argument("--hf-dtype", default="float32", choices=HF_DTYPES,
                        help="dtype of the Hugging Face peer's dequantized weights and cache (default float32)")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="device memory bandwidth in GB/s for the effective-GB/s column (default: probed on CUDA)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take (default 3600)")
    parser.add_argument("--json", dest="json_path", default=None, help="write rows, ratios and every run here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    serve = parser.add_argument_group("load test of a server (--serve)")
    serve.add_argument("--serve", default=None, metavar="URL|auto",
                       help="drive a running `oval-edge serve` at URL (loopback), or 'auto' to start one here")
    serve.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (default 32)")
    serve.add_argument("--requests-per-client", type=int, default=4, help="requests each client sends (default 4)")
    serve.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    serve.add_argument("--scenario", choices=("burst", "multiturn", "shared-prefix"), default="burst",
                       help="burst: every client sends its requests back to back (default); multiturn: each client "
                            "holds a chat and resends the whole conversation every turn; shared-prefix: burst with "
                            "one long system prompt (--turn-tokens long) shared by every request")
    serve.add_argument("--turns", type=int, default=8, help="turns per conversation with --scenario multiturn (8)")
    serve.add_argument("--turn-tokens", type=int, default=300,
                       help="new tokens of text each turn adds with --scenario multiturn, or the shared system "
                            "prompt's length with --scenario shared-prefix (default 300)")
    serve.add_argument("--time-limit", type=float, default=600.0, help="seconds before the load test gives up")
    serve.add_argument("--api-key", default=None, help="bearer token for the server (or OVAL_EDGE_API_KEY)")
    serve.add_argument("--serve-args", default="",
                       help="extra arguments for the server that --serve auto starts, e.g. \"--max-batch 8\"")


def dense_kv_elements(shape) -> dict:
    """What a dense engine's decode step reads from its K/V cache, per cached token (for the peers' computed bytes):
    K and V of every layer reading the whole context at its head dim ("full": Gemma 4's at global_head_dim, its
    shared layers included: they read their sources' K/V), and of every sliding layer per token of its window
    ("window", "sliding_window"); a hybrid's state layers read no K/V."""
    def elements(kind: str) -> int:
        return sum(2 * shape.kv_heads * shape.layer_head_dim(i) for i, k in enumerate(shape.kinds) if k == kind)

    return {"full": elements("full"), "window": elements("sliding"), "sliding_window": shape.sliding_window}


def run(args: argparse.Namespace) -> int:
    if args.serve:
        from oval_edge.tools.load.command import run_load

        return run_load(args)
    settings = build_settings(args)
    from oval_edge.tools.plan.model import read_model_shape

    shape = read_model_shape(settings.model)
    kv_elements = dense_kv_elements(shape)
    notes = [f"model: {settings.model_name}: {shape.describe()}"]
    for context in settings.contexts:
        length = prompt_length(context, settings.gen, shape.max_context)
        if length != context:
            notes.append(f"context {context}: prompt shortened to {length} tokens so prompt + {settings.gen} "
                         f"generated (+ {COUNTED_STEPS} counted) fit the model's {shape.max_context} positions")
    for engine, why in settings.skipped.items():
        notes.append(f"{engine} skipped: {why}")
    bandwidth, bandwidth_note = _bandwidth(args.bandwidth, settings.device)
    print(f"oval-edge bench: engines {', '.join(settings.engines)}; contexts {list(settings.contexts)}; "
          f"{settings.gen} generated tokens; {settings.runs} run(s) each; device {settings.device}, "
          f"{settings.threads} threads")
    for note in notes[1:]:
        print("  " + note)

    from .runner import build_prompts, load_tokenizer, run_all

    prompts = build_prompts(load_tokenizer(settings.model), settings.contexts, settings.gen, shape.max_context)
    runs = run_all(settings, prompts, kv_elements, progress=not args.no_progress)
    rows = label_rows(aggregate(runs, bandwidth), settings.model_name, settings.synthetic)
    report = report_json(_meta(settings, bandwidth, bandwidth_note, notes), rows, runs)
    print()
    print(format_table(rows, report["ratios"], report["meta"]))
    if args.json_path:
        write_json_report(args.json_path, report)
    return 0 if all(r["runs_ok"] > 0 for r in rows) else 1


def build_settings(args: argparse.Namespace) -> BenchSettings:
    from oval_edge.config import OvalConfig

    OvalConfig(page_size=args.page_size, top_k=args.top_k)  # a bad value fails now, not in every worker
    engines = parse_engines(args.engines, args.peers)
    engines = with_groups(with_reuse(engines, getattr(args, "reuse_tau", None)), getattr(args, "group_pages", None))
    schema = _read_schema(getattr(args, "schema", None))
    engines = with_schema(engines, schema)
    device = _resolve_device(args.device)
    model, model_name = _model(args)
    skipped = {}
    if "llama.cpp" in engines:
        why = _llamacpp_unavailable(model)
        if why:
            print(f"oval-edge bench: skipping llama.cpp: {why}")
            skipped["llama.cpp"] = why
    engines = tuple(e for e in engines if e not in skipped)
    from oval_edge.runtime.model.origin.source import resolve_model

    source = resolve_model(model)  # a missing or wrong model fails here, naming its path
    return BenchSettings(
        contexts=parse_int_list(args.contexts, "--contexts"), engines=engines, gen=args.gen, runs=args.runs,
        model=model, model_name=model_name or source.name, synthetic=model_name is not None,
        model_dir=source.directory, gguf_file=source.gguf_file, quant=args.quant, device=device,
        threads=args.threads if args.threads is not None else default_threads(), page_size=args.page_size,
        top_k=args.top_k, decode_step=args.decode_step, oval_from=args.oval_from,
        cuda_graphs=args.cuda_graphs, hf_dtype=args.hf_dtype,
        timeout_s=args.timeout, skipped=skipped, schema=schema,
    )


def _read_schema(path: str | None):
    """--schema's JSON schema, or None; a file that is not JSON fails here, naming it."""
    if path is None:
        return None
    import json

    try:
        with open(path, encoding="utf-8") as handle:
            schema = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--schema {path}: cannot read a JSON schema from it ({exc})") from exc
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"--schema {path}: a JSON schema is an object (or a boolean), not {type(schema).__name__}")
    return schema


def _model(args: argparse.Namespace) -> tuple[str, str | None]:
    """(what the engines load, the synthetic model's name or None): --model synthetic-long becomes the path of its
    cached GGUF (written now if missing, before any worker starts)."""
    given = {flag: value for flag, value in (("--synthetic-positions", getattr(args, "synthetic_positions", None)),
                                              ("--synthetic-seed", getattr(args, "synthetic_seed", None)))
             if value is not None}
    if args.model != SYNTHETIC_MODEL:
        if given:
            raise ValueError(f"{', '.join(given)} apply to --model {SYNTHETIC_MODEL} only (the model is {args.model})")
        return args.model, None
    from oval_edge.tools.gguf_write.synthetic import bundled_shape, synthetic_gguf

    shape = bundled_shape(given.get("--synthetic-positions", DEFAULT_POSITIONS), given.get("--synthetic-seed", 0))
    return synthetic_gguf(shape, announce=lambda text: print(f"oval-edge bench: {text}")), shape.describe()


def _resolve_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device; use --device cpu")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _llamacpp_unavailable(model: str) -> str | None:
    """Why llama.cpp cannot run here (None when it can): not importable, or the model is not a GGUF file."""
    try:
        import llama_cpp  # noqa: F401 - importing is the check (a broken native build fails here)
    except Exception as exc:  # noqa: BLE001 - ImportError or an OSError from the shared library
        return (f"llama-cpp-python is not importable ({type(exc).__name__}: {exc}); install it with "
                "CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install llama-cpp-python")
    from oval_edge.runtime.model.origin.source import resolve_model

    if not resolve_model(model).gguf_file:
        return f"llama.cpp needs a GGUF file and --model {model} is a Hugging Face folder"
    return None


def _bandwidth(given: float | None, device: str) -> tuple[float | None, str]:
    if given is not None:
        if not given > 0:
            raise ValueError(f"--bandwidth={given!r} must be a positive number of GB/s")
        return given, "--bandwidth"
    if device != "cuda":
        return None, "unknown on the CPU: pass --bandwidth GB/s"
    from oval_edge.jetson.probe import probe

    module = probe().module
    if module is None or module.bandwidth_gbps is None:
        return None, "unknown for this device: pass --bandwidth GB/s"
    return module.bandwidth_gbps, f"{module.title}: {module.bandwidth_note}"


def _meta(settings: BenchSettings, bandwidth: float | None, bandwidth_note: str, notes: list[str]) -> dict:
    from importlib import metadata

    versions = {}
    for name in ("torch", "transformers", "bitsandbytes", "llama-cpp-python"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "tool": "oval-edge bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "contexts": list(settings.contexts), "engines": list(settings.engines), "skipped": settings.skipped,
        "gen": settings.gen, "runs": settings.runs, "model": settings.model, "model_name": settings.model_name,
        "synthetic": settings.synthetic, "quant": settings.quant,
        "device": settings.device, "threads": settings.threads, "page_size": settings.page_size,
        "top_k": settings.top_k, "decode_step": settings.decode_step, "oval_from": settings.oval_from, "cuda_graphs": settings.cuda_graphs, "hf_dtype": settings.hf_dtype, "bandwidth_gb_s": bandwidth,
        "bandwidth_note": bandwidth_note, "versions": versions, "notes": notes,
    }
