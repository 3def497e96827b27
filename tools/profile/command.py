"""`oval-edge profile`: measure each page size (with the top-k that reads about B tokens per step) on this device
and pick the best-quality one among those tied for the fastest step.

Per page size: the pool the memory budget buys (pages, longest request, summary memory), the median decode step
at the target context and the seal cost (tools/profile/measure.py: a real engine, prefilled to the context), and
KL / top-1 against dense on a short calibration text (the eval harness). Then, among the page sizes that hold the
context with KL <= --max-kl, those within --speed-tolerance of the fastest step tie and the lowest KL of them is
chosen (tools/profile/choice.py), explained with its runner-up, and written as a TOML for `serve --config`. For
the chosen one, OVAL's and the dense decode step are timed at several context lengths: the length from which OVAL is
not slower is written as [server] oval_from (tools/profile/crossover.py; --no-crossover skips it).
Exit status: 0 with a choice, 1 when no page size qualifies (nothing is written to --write-config), 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.runtime.model.origin.source import quant_choices
from oval_edge.tools.eval.policies import parse_int_list
from oval_edge.tools.timing import Stopwatch, quartiles
from oval_edge.units import format_bytes, parse_bytes

from .choice import DEFAULT_SPEED_TOLERANCE  # choice.py imports no torch: --help stays fast

# (full, --quick) defaults of the options that size the run; --quick finishes in minutes on 2 CPU cores.
RUN_DEFAULTS = {
    "page_sizes": ("16,32,64,128", "16,32,64"),
    "context": (4096, 2048),
    "steps": (32, 12),
    "warmup": (4, 2),
    "calib_tokens": (1024, 640),
    "calib_steps": (256, 128),
    "crossover_lengths": ("256,512,768,1024,1536,2048,3072,4096", "512,1024,2048,3072,4096"),
}
DEFAULT_BUDGET = "1.5GiB"
DEFAULT_MAX_KL = 0.1


def _default(name: str) -> str:
    full, quick = RUN_DEFAULTS[name]
    return f" (default {full}; {quick} with --quick)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    base = OvalConfig()
    wide = base.replace(page_size=128, top_k=1).token_budget
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n\n".join(textwrap.fill(paragraph, 100) for paragraph in (
        "top-k per page size: a sparse step reads T = (sink_pages + k) * page_size + max(window, page_size) K/V "
        f"tokens per KV head (sink_pages {base.sink_pages}, window {base.window_max}: the serve defaults); k is the "
        "k >= 1 whose T is nearest --tokens-per-step, a tie taking the smaller k. Large pages can read more than "
        f"asked: at page 128, k = 1 already reads {wide}.",
        "choice: among the page sizes that hold --context in the budget and have KL <= --max-kl (a hard ceiling), "
        "those whose median decode step is within --speed-tolerance of the fastest (never less than the fastest "
        "step's p25-p75 spread) are equally fast, and the lowest KL of them wins; the explanation names the "
        "runner-up and what was traded. When none qualifies, the command says what to change, writes no config and "
        "exits 1.",
        "decode is timed on a real engine sized from the budget as serve sizes it, its context filled by a dense "
        "prefill once per page size; KL and top-1 come from the eval harness (teacher-forced, same weights).",
    ))
    run = parser.add_argument_group("what to profile")
    run.add_argument("--model", default="default", help="a .gguf file, a Hugging Face folder, or 'default'")
    run.add_argument("--quant", default="auto", choices=quant_choices("auto"), help="weights, as serve loads them")
    run.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    run.add_argument("--memory-budget", default=DEFAULT_BUDGET,
                     help=f"bytes for weights + workspace + KV pool, as serve takes it (default {DEFAULT_BUDGET}; "
                          "`oval-edge plan --device auto` says what this board can give)")
    run.add_argument("--context", type=int, default=None,
                     help="target context in tokens, where decode is timed" + _default("context"))
    run.add_argument("--page-sizes", default=None, help="comma-separated page sizes" + _default("page_sizes"))
    run.add_argument("--tokens-per-step", type=int, default=base.token_budget,
                     help="B: K/V tokens read per step, from which top-k is derived (default: the default "
                          f"config's {base.token_budget})")
    run.add_argument("--max-kl", type=float, default=DEFAULT_MAX_KL,
                     help=f"largest mean KL(dense || OVAL) per token, in nats, that a choice may have (default "
                          f"{DEFAULT_MAX_KL})")
    run.add_argument("--speed-tolerance", type=float, default=DEFAULT_SPEED_TOLERANCE,
                     help="page sizes whose median step is within this fraction of the fastest count as equally "
                          "fast, and the lowest KL of them wins (default "
                          f"{DEFAULT_SPEED_TOLERANCE:g}, i.e. {DEFAULT_SPEED_TOLERANCE * 100:g}%%; widened to the measured "
                          "p25-p75 spread when that is wider)")
    run.add_argument("--quick", action="store_true",
                     help="fewer page sizes, a shorter context, fewer steps and a shorter calibration text")
    how = parser.add_argument_group("measurement")
    how.add_argument("--steps", type=int, default=None, help="timed decode steps per page size" + _default("steps"))
    how.add_argument("--warmup", type=int, default=None, help="decode steps run first, not timed" + _default("warmup"))
    how.add_argument("--text", default=None, help="calibration text, UTF-8 (default: the shipped "
                     "tools/data/botchan_ch1-2.txt); it also fills the context")
    how.add_argument("--calib-tokens", type=int, default=None,
                     help="tokens of calibration text" + _default("calib_tokens"))
    how.add_argument("--calib-steps", type=int, default=None,
                     help="teacher-forced steps at the end of the calibration text, the rest being prefilled "
                          "densely" + _default("calib_steps"))
    how.add_argument("--crossover-lengths", default=None,
                     help="context lengths where the chosen page size's OVAL step and the dense step are timed, to "
                          "find oval_from: the length from which OVAL is not slower, written to [server] (lengths "
                          "whose two pools do not fit the budget's are left out)" + _default("crossover_lengths"))
    how.add_argument("--crossover-clock", choices=("wall", "cpu"), default="wall",
                     help="what times those steps: wall (default: what a client sees) or cpu (the profiling thread's "
                          "CPU time, --device cpu --threads 1 only: on a host other processes load, time waiting for "
                          "a core is left out of both modes alike)")
    how.add_argument("--no-crossover", action="store_true",
                     help="skip that measurement: the config gets no oval_from and serve uses the device's default")
    how.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                     help=f"prompt tokens per prefill step, as serve ({DEFAULT_PREFILL_CHUNK})")
    how.add_argument("--threads", type=int, default=1,
                     help="CPU threads (default 1: decode is many small ops, and on a shared machine more threads "
                          "stall each other; pass the count your deployment uses)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json_path", default=None, help="write the rows, the choice and the device here")
    out.add_argument("--plot", default=None, help="write a PNG: decode latency and KL against page size")
    out.add_argument("--write-config", default=None, help="write the chosen configuration as TOML for serve --config")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} is out of range: allowed integers in [{low}, {high}]")
    return value


def settings_from(args: argparse.Namespace) -> dict:
    """Every option resolved (--quick defaults) and validated before the model loads."""
    from .choice import check_speed_tolerance, top_k_for

    pick = {name: getattr(args, name) if getattr(args, name) is not None else pair[1 if args.quick else 0]
            for name, pair in RUN_DEFAULTS.items()}
    page_sizes = parse_int_list(pick["page_sizes"], "--page-sizes", 16, 256)
    base = OvalConfig()
    for p in page_sizes:
        base.replace(page_size=p)  # a power of two, or a ValueError that says so
    budget = parse_bytes(args.memory_budget, "--memory-budget")
    if not (args.max_kl > 0 and args.max_kl < float("inf")):
        raise ValueError(f"--max-kl={args.max_kl!r} must be a positive number of nats, e.g. 0.1")
    tokens = _check_int("--tokens-per-step", args.tokens_per_step, 1, 1 << 20)
    top_ks = {p: top_k_for(p, tokens, base) for p in page_sizes}
    s = dict(page_sizes=page_sizes, top_ks=top_ks, memory_budget=budget, tokens_per_step=tokens,
             max_kl=float(args.max_kl), speed_tolerance=check_speed_tolerance(args.speed_tolerance),
             context=_check_int("--context", pick["context"], 2, 1 << 24),
             steps=_check_int("--steps", pick["steps"], 1, 100_000),
             warmup=_check_int("--warmup", pick["warmup"], 0, 100_000),
             calib_tokens=_check_int("--calib-tokens", pick["calib_tokens"], 2, 1 << 24),
             calib_steps=_check_int("--calib-steps", pick["calib_steps"], 1, 1 << 24),
             prefill_chunk=_check_int("--prefill-chunk", args.prefill_chunk, 16, 65536),
             threads=_check_int("--threads", args.threads, 1, 1024), quick=bool(args.quick),
             crossover_lengths=parse_int_list(pick["crossover_lengths"], "--crossover-lengths", 16, 1 << 24),
             crossover=not args.no_crossover, crossover_clock=args.crossover_clock)
    start = s["calib_tokens"] - s["calib_steps"]
    if start < 1:
        raise ValueError(f"--calib-steps={s['calib_steps']} must be below --calib-tokens={s['calib_tokens']} "
                         "(the tokens before the steps are prefilled)")
    widest = max(base.replace(page_size=p, top_k=k).token_budget for p, k in top_ks.items())
    if s["calib_tokens"] <= widest:
        raise ValueError(f"--calib-tokens={s['calib_tokens']} is within the {widest} tokens a step reads: every "
                         f"policy would attend densely and KL would be 0; use more than {widest} (e.g. {4 * widest})")
    if args.text is not None and not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text} is not a file")
    for option, path in (("--json", args.json_path), ("--plot", args.plot), ("--write-config", args.write_config)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):  # fail now, not after minutes
            raise ValueError(f"{option} {path}: folder {folder} does not exist or is not writable")
    s["text"] = args.text
    return s


def run(args: argparse.Namespace) -> int:
    s = settings_from(args)
    import torch

    torch.set_num_threads(s["threads"])
    from oval_edge.runtime.model.loader import describe, load_model
    from oval_edge.tools.eval.text import SHIPPED_TEXT, read_text

    from .device import describe_record, device_record

    watch = Stopwatch()
    loaded = load_model(args.model, args.quant, args.device)
    limit = loaded.config.max_position_embeddings
    if s["context"] > limit or s["calib_tokens"] > limit:
        raise ValueError(f"--context {s['context']} / --calib-tokens {s['calib_tokens']}: the model has {limit} "
                         "positions; lower them")
    device = device_record(loaded.device, s["threads"])
    print(describe(loaded))
    print(f"device: {describe_record(device)}")
    print(f"budget {format_bytes(s['memory_budget'])}; target context {s['context']} tokens; about "
          f"{s['tokens_per_step']} K/V tokens read per step -> top-k "
          + ", ".join(f"{k} at page {p}" for p, k in s["top_ks"].items()) + f"; --max-kl {s['max_kl']:g}")
    text_path = s["text"] or SHIPPED_TEXT
    text_ids = loaded.tokenizer(read_text(text_path), add_special_tokens=False)["input_ids"]
    if len(text_ids) < s["calib_tokens"]:
        raise ValueError(f"{text_path} has {len(text_ids)} tokens, fewer than --calib-tokens {s['calib_tokens']}")
    rows = _measure(loaded, s, text_ids, show_progress=not args.no_progress)
    crossover = None
    if s["crossover"]:  # oval_from for the page size the rows choose (tools/profile/crossover.py)
        from .crossover import profile_crossover

        crossover = profile_crossover(loaded, s, rows, text_ids, show_progress=not args.no_progress)
    s["text"] = text_path
    return _conclude(args, s, loaded, device, rows, watch.seconds, crossover)


def _measure(loaded, s: dict, text_ids: list[int], show_progress: bool):
    from tqdm import tqdm

    from .choice import ProfileRow
    from .measure import (
        context_ids, decode_steps_needed, measure_decode, measure_fidelity, pool_figures, probe_pool_bytes,
    )

    base = OvalConfig(memory_budget=s["memory_budget"])
    configs = [base.replace(page_size=p, top_k=s["top_ks"][p]) for p in s["page_sizes"]]
    need = decode_steps_needed(s["context"], s["warmup"], s["steps"])
    # Pools first, before anything else is held: each is sized from the same resident memory, as serve's is.
    pools = [pool_figures(loaded, c, s["prefill_chunk"]) for c in configs]
    rows = [ProfileRow(
        page_size=c.page_size, top_k=c.top_k, tokens_per_step=c.token_budget, pages=f.pages,
        pool_tokens=f.pages * c.page_size, max_context=f.token_limit, summary_bytes=f.summary_bytes,
        fits_context=need <= f.token_limit, bytes_per_page=f.bytes_per_page,
        summary_bytes_per_page=f.summary_bytes_per_page, pool_bytes=f.pool_bytes,
        note="" if need <= f.token_limit else f"the pool holds {f.token_limit} tokens per request; the timed "
        f"request needs {need}") for c, f in zip(configs, pools)]
    timed = [i for i, r in enumerate(rows) if r.fits_context]
    probes_bytes = sum(probe_pool_bytes(pools[i], rows[i].page_size, need) for i in timed)
    interleave = bool(timed) and probes_bytes <= min(pools[i].pool_bytes for i in timed)
    prompt = context_ids(text_ids, s["context"])
    per_page = -(-s["context"] // s["prefill_chunk"]) + 1 + s["warmup"] + s["steps"]
    with tqdm(total=len(timed) * per_page, desc=f"decode at {s['context']} tokens", unit="step",
              disable=not show_progress) as bar:
        figures = measure_decode(loaded, [configs[i] for i in timed], prompt, s["warmup"], s["steps"],
                                 s["prefill_chunk"], interleave, bar.update)
    for i, f in zip(timed, figures):
        r = rows[i]
        r.decode_ms_p25, r.decode_ms_median, r.decode_ms_p75 = quartiles(f.decode_ms)
        r.decode_steps, r.seal_ms, r.seal_page_ms, r.seal_pages = len(f.decode_ms), f.seal_ms, f.seal_page_ms, \
            f.seal_pages
        r.kv_bytes_per_step, r.interleaved = f.kv_bytes_per_step, f.interleaved
    ids = text_ids[: s["calib_tokens"]]
    start = s["calib_tokens"] - s["calib_steps"]
    for i, row in enumerate(rows):
        if show_progress:
            print(f"fidelity {i + 1}/{len(rows)}: page {row.page_size}, top-k {row.top_k}", file=sys.stderr)
        config = configs[i].replace(memory_budget=None)
        fid = measure_fidelity(loaded, ids, start, config, s["prefill_chunk"], show_progress)
        row.kl, row.top1, row.ppl, row.fidelity_steps = fid.kl, fid.top1, fid.ppl, fid.steps
    return rows


def _conclude(args, s: dict, loaded, device: dict, rows, seconds: float, crossover=None) -> int:
    from oval_edge.tools.bench.report import write_json_report

    from .choice import NoConfiguration, explain, rank
    from .report import config_sections, format_table, report_json, write_config

    try:
        ranking = rank(rows, s["max_kl"], s["tokens_per_step"], s.get("speed_tolerance", DEFAULT_SPEED_TOLERANCE))
        chosen, failure = ranking.chosen, None
        explanation = explain(chosen, rows, s["max_kl"], s["context"], ranking.asked, s["tokens_per_step"])
    except NoConfiguration as exc:
        ranking, chosen, failure, explanation = None, None, str(exc), str(exc)
    print("\n" + format_table(rows, chosen, ranking.runner_up if ranking is not None else None))
    print("\n" + explanation)
    if crossover is not None:
        print(f"\ndecode tok/s, OVAL (page {chosen.page_size}, top-k {chosen.top_k}) and dense, median of "
              f"{s['steps']} steps each, alternated, {crossover.clock} clock:\n" + crossover.table())
    settings = {k: v for k, v in s.items() if k != "top_ks"}
    settings.update(model=loaded.name, quant=loaded.quant, seconds=round(seconds, 1))
    if args.json_path:
        report = report_json(device, settings, rows, chosen, explanation, ranking)
        report["crossover"] = crossover.record() if crossover is not None else None
        write_json_report(args.json_path, report)
    if args.plot:
        from .device import describe_record
        from .plot import write_plot

        write_plot(args.plot, rows, chosen, s["max_kl"], f"{loaded.name} ({loaded.quant}), budget "
                   f"{format_bytes(s['memory_budget'])}, context {s['context']}, ~{s['tokens_per_step']} tokens/step"
                   f"\n{describe_record(device)}")
        print(f"wrote {args.plot}")
    print(f"profile took {seconds:.0f} s (model load and measurements)")
    if failure is not None:
        print(f"oval-edge profile: {failure}", file=sys.stderr)
        return 1
    if args.write_config:
        sections = config_sections(chosen, OvalConfig(), args.model, loaded.source.path, loaded.quant,
                                   str(loaded.device), settings, device)
        if crossover is not None:
            sections["server"]["oval_from"] = crossover.oval_from
        print(f"wrote {write_config(args.write_config, sections)}")
    return 0
