"""`oval-edge calibrate`: fit the output-aware window module ([R-window-module]) and freeze the oval scorer's eta and r
on the model's own dense attention over a calibration text.

    oval-edge calibrate --text tools/data/botchan_ch1-2.txt --skip 2048 --length 8192 --out window.safetensors \
        --write-config oval-edge.toml

1. Prefill the text densely through the runtime, recording every layer's normed hidden state (calibrate_capture).
2. Per sparse layer and sample position: the window target (smallest recent window holding --share of the mass
   the largest window would hold).
3. Freeze (eta, r) and the record format: on every --scorer-stride-th sample, the attention output error of sink +
   the scorer's top-k pages + the window against dense attention (calibrate_scorer).
4. Fit the module to the window targets on the calibration split; report the held-out fit (calibrate_fit).
5. Write the module (safetensors, marked calibrated) and, with --write-config, eta, rank and record into the TOML
   `serve --config` reads (the module itself too with --enable-module).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.geometry import RECORD_FORMATS
from oval_edge.runtime.model.origin.source import quant_choices
from oval_edge.tools.eval.policies import parse_float_list, parse_int_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    run = parser.add_argument_group("model and text")
    run.add_argument("--model", default="default", help="a .gguf file, a Hugging Face folder, or 'default'")
    run.add_argument("--quant", default="none", choices=quant_choices("none"), help="weights while calibrating")
    run.add_argument("--device", default="auto", help="cpu, cuda or auto")
    run.add_argument("--threads", type=int, default=2, help="CPU threads")
    run.add_argument("--text", default="generated",
                     help="a UTF-8 text file, or 'generated' (the model writes its own text from --seed)")
    run.add_argument("--skip", type=int, default=0, help="tokens skipped at the start of the text (e.g. the part "
                     "`oval-edge eval` measures on, so that calibration and evaluation do not overlap)")
    run.add_argument("--length", type=int, default=4096, help="tokens of calibration text")
    run.add_argument("--seed", type=int, default=0, help="seed of the generated text and of the fit")
    run.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                     help=f"tokens per dense prefill chunk (default {DEFAULT_PREFILL_CHUNK})")
    sel = parser.add_argument_group("selection geometry (as the runtime will decode)")
    sel.add_argument("--page-size", type=int, default=32)
    sel.add_argument("--top-k", type=int, default=4)
    sel.add_argument("--sink-pages", type=int, default=1)
    sel.add_argument("--dense-layers", type=int, default=2)
    sel.add_argument("--window", type=int, default=64, help="the fixed window the page scorer is fitted under")
    tgt = parser.add_argument_group("window targets and the module")
    tgt.add_argument("--share", type=float, default=0.9,
                     help="the window target holds this share of the mass the largest window would hold")
    tgt.add_argument("--window-range", default="16,128",
                     help="MIN,MAX window in tokens the targets are normalised into (the runtime maps the module's "
                          "reach linearly into its own window_min..window_max)")
    tgt.add_argument("--start", type=int, default=256, help="first sample position")
    tgt.add_argument("--stride", type=int, default=2, help="sample every STRIDE-th position")
    tgt.add_argument("--width", type=int, default=16, help="hidden units of the module's MLP (per layer)")
    tgt.add_argument("--bins", type=int, default=8, help="weights per head (their entropy sets the window)")
    tgt.add_argument("--steps", type=int, default=1200, help="optimiser steps")
    tgt.add_argument("--noise", type=float, default=1.0, help="input noise (regulariser) in channel spreads")
    sco = parser.add_argument_group("oval scorer")
    sco.add_argument("--etas", default="0,0.25,0.5,0.75,1", help="eta values tried")
    sco.add_argument("--ranks", default="2,4,8", help="ranks r tried (the smallest within --rank-tolerance wins)")
    sco.add_argument("--rank-tolerance", type=float, default=0.02,
                     help="relative output error a smaller rank may add over the best")
    sco.add_argument("--records", default="float,int8,int4",
                     help="record formats each (eta, rank) is scored through, as the pool stores them")
    sco.add_argument("--record-tolerance", type=float, default=0.02,
                     help="relative output error a more compact record may add over the float record")
    sco.add_argument("--scorer-stride", type=int, default=8, help="score pages for every N-th sample position")
    out = parser.add_argument_group("output")
    out.add_argument("--out", required=True, help="the module file to write (.safetensors)")
    out.add_argument("--write-config", metavar="FILE.toml", default=None,
                     help="write eta, rank and record into this config's [oval] table (created if missing)")
    out.add_argument("--enable-module", action="store_true",
                     help="with --write-config: also turn the module on there (window_module, window_min/max)")
    out.add_argument("--json", dest="json_path", default=None, help="write the full report as JSON here")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")


def _pair(text: str, option: str) -> tuple[int, int]:
    values = parse_int_list(text, option, 3, 65536)
    if len(values) != 2 or values[0] >= values[1]:
        raise ValueError(f"{option}={text!r} must be MIN,MAX with 3 <= MIN < MAX, e.g. 16,128")
    return values[0], values[1]


def _settings(args: argparse.Namespace):
    """Validate every option before the model loads, so a typo costs nothing."""
    from .fit import FitSettings
    from .run import CalibrationSettings

    for name, value, low, high in (("--threads", args.threads, 1, 1024), ("--skip", args.skip, 0, 1 << 24),
                                   ("--length", args.length, 64, 1 << 20), ("--stride", args.stride, 1, 4096),
                                   ("--width", args.width, 1, 4096), ("--bins", args.bins, 2, 256),
                                   ("--steps", args.steps, 1, 1_000_000),
                                   ("--scorer-stride", args.scorer_stride, 1, 4096),
                                   ("--prefill-chunk", args.prefill_chunk, 16, 65536)):
        if not low <= value <= high:
            raise ValueError(f"{name}={value} is out of range: allowed [{low}, {high}]")
    if not 0 <= args.start < args.length - 1:
        raise ValueError(f"--start={args.start} must be in [0, --length - 2 = {args.length - 2}]")
    if not 0.0 < args.share <= 1.0:
        raise ValueError(f"--share={args.share} is out of range: allowed (0, 1]")
    for name, value in (("--rank-tolerance", args.rank_tolerance), ("--record-tolerance", args.record_tolerance)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name}={value} is out of range: allowed [0, 1)")
    records = tuple(r.strip() for r in args.records.split(",") if r.strip())
    if "float" not in records or any(r not in RECORD_FORMATS for r in records):
        raise ValueError(f"--records={args.records!r}: a comma-separated list of {', '.join(RECORD_FORMATS)} that "
                         "includes float (the reference)")
    if not args.noise >= 0.0:
        raise ValueError(f"--noise={args.noise} must be >= 0")
    if args.text != "generated" and not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text} is not a file (or say --text generated)")
    if args.enable_module and not args.write_config:
        raise ValueError("--enable-module writes into a config file: give --write-config FILE.toml too")
    config = OvalConfig(page_size=args.page_size, top_k=args.top_k, sink_pages=args.sink_pages,
                        window_min=args.window, window_max=args.window, dense_layers=args.dense_layers,
                        kv_dtype="float32")
    return CalibrationSettings(
        config=config, window_range=_pair(args.window_range, "--window-range"), share=args.share, start=args.start,
        stride=args.stride, scorer_stride=args.scorer_stride,
        etas=tuple(parse_float_list(args.etas, "--etas", 0.0, 1.0)),
        ranks=tuple(parse_int_list(args.ranks, "--ranks", 1, 256)), rank_tolerance=args.rank_tolerance,
        records=records, record_tolerance=args.record_tolerance,
        width=args.width, bins=args.bins, fit=FitSettings(steps=args.steps, noise=args.noise, seed=args.seed),
        prefill_chunk=args.prefill_chunk)


def run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    torch.set_num_threads(args.threads)
    from oval_edge.runtime.model.loader import describe, load_model
    from oval_edge.sparse.window_module import save_module
    from oval_edge.tools.eval.text import encode_text, generate_text, read_text

    from .report import fit_table, scorer_table, update_config
    from .run import calibrate

    began = time.perf_counter()
    loaded = load_model(args.model, args.quant, args.device)
    limit = loaded.config.max_position_embeddings
    if args.length > limit:  # the calibration text starts at position 0 whatever --skip drops before it
        raise ValueError(f"--length {args.length} tokens exceed the model's context of {limit}")
    print(describe(loaded))
    if args.text == "generated":
        text = generate_text(loaded, args.skip + args.length + 64, args.seed, show_progress=not args.no_progress)
        source = f"text written by the model (seed {args.seed})"
    else:
        text, source = read_text(args.text), args.text
    ids = encode_text(loaded.tokenizer, text, args.skip + args.length, source)[args.skip :]
    label = f"{source}, tokens {args.skip}..{args.skip + args.length - 1}"
    print(f"calibration text: {label}")
    result = calibrate(loaded, ids, dataclasses.replace(settings, text=label), show_progress=not args.no_progress)
    print("phases: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.timings.items()))
    path = save_module(result.module, args.out)
    lo, hi = settings.window_range
    report, scorer = result.report, result.scorer
    print("\nwindow module fit (tokens; held-out = every 5th block of 64 positions, never trained on):")
    print(fit_table(report))
    print(f"\noval scorer at top-{settings.config.top_k}, window {args.window} (lower error is better):")
    print(scorer_table(scorer.table))
    print(f"frozen: eta={scorer.eta:g}, rank={scorer.rank}, record={scorer.record}")
    print(f"wrote {path} (mean reach {report['mean_reach']:.3f} on the calibration split: mean window "
          f"{lo + report['mean_reach'] * (hi - lo):.1f} tokens in [{lo}, {hi}])")
    if args.write_config:
        written = update_config(args.write_config, scorer.eta, scorer.rank,
                                (path, lo, hi) if args.enable_module else None, scorer.record)
        print(f"wrote eta={scorer.eta:g}, rank={scorer.rank}, record={scorer.record}"
              + (", the window module" if args.enable_module else "") + f" to {written}")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump({"card": dataclasses.asdict(result.module.card), "scorer": scorer.table}, handle, indent=2)
        print(f"wrote {args.json_path}")
    print(f"calibrate took {time.perf_counter() - began:.0f} s")
    return 0
