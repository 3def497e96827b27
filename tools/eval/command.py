"""`oval-edge eval`: fidelity (KL, top-1, perplexity) and passkey retrieval of OVAL against dense attention and
the policies a user could pick instead (window-only, Quest), at equal K/V tokens read per step, with the oracle
page selection as the reference floor. Everything runs through the real runtime (PagedLlama over a PagePool);
only the oracle reads every key.

The defaults are a quick run (minutes on 2 CPU cores): 192 teacher-forced steps over 1024 tokens the model writes
itself, and a 1024-token passkey at 3 depths x 2 keys. The [R-oval-decode] setting is
    oval-edge eval --text tools/data/botchan_ch1-2.txt --length 4096 --start 1024 --tasks fidelity --eta 0,0.5
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.geometry import RECORD_FORMATS
from oval_edge.runtime.model.origin.source import quant_choices
from oval_edge.units import format_bytes, parse_bytes

from .activations import EVAL_DTYPES, dtype_name, load_models
from .policies import (ALL_POLICIES, POLICY_NAMES, build_policies, parse_float_list, parse_int_list,
                       parse_names)
from .weights import PEERS

TASKS = ("fidelity", "passkey")
# --kv-dtype: 'auto' is serve's default for the device (OvalConfig.pool_dtype: bfloat16 on a CPU)
EVAL_KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    run = parser.add_argument_group("model and run")
    run.add_argument("--model", default="default", help="a .gguf file, a Hugging Face folder, or 'default'")
    run.add_argument("--quant", default="auto", choices=quant_choices("auto"),
                     help="weights, as serve loads them (auto: a GGUF's own blocks); the fidelity task also reports "
                          "the dense perplexity of the exact weights (none) on the same tokens")
    run.add_argument("--peers", default="", help=f"comma-separated peers whose perplexity on the same GGUF and "
                                                 f"tokens the weights table adds: {', '.join(PEERS)}")
    run.add_argument("--no-exact", action="store_true",
                     help="skip the exact-weights perplexity (a second load and dense pass)")
    run.add_argument("--device", default="auto", help="cpu, cuda or auto")
    run.add_argument("--dtype", default="auto",
                     help="comma-separated activation dtypes, as serve's --dtype: auto (serve's default: float32 on a "
                          "CPU, bfloat16 on CUDA from compute capability 8.0), float32, bfloat16, float16. Several, "
                          "e.g. float32,bfloat16, load the model once each and decode in lockstep: every row is "
                          "compared with the first one's dense fp32-K/V row, and 'KL own' with its own dense row. "
                          "bfloat16 runs on a CPU too (torch's bf16 matmuls: what CUDA computes, ~5x slower)")
    run.add_argument("--threads", type=int, default=1,
                     help="CPU threads (decode steps are many small ops; more threads rarely help, on a shared "
                          "machine they hurt)")
    run.add_argument("--tasks", default="fidelity,passkey", help=f"comma-separated: {', '.join(TASKS)}")
    run.add_argument("--policies", default=",".join(POLICY_NAMES[1:]),
                     help="compared with dense: window, quest, oval, oracle; and the window policies entropy "
                          "(window from the page-score entropy) and module (from --window-module)")
    run.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                     help=f"tokens per dense prefill chunk (default {DEFAULT_PREFILL_CHUNK})")
    oval = parser.add_argument_group("budget (every policy reads the same tokens per step)")
    oval.add_argument("--page-size", default="32", help="comma-separated page sizes (one pass each)")
    oval.add_argument("--top-k", default="4", help="comma-separated pages selected per KV head")
    oval.add_argument("--eta", default="0", help="comma-separated oval eta values (0 = key-only basis)")
    oval.add_argument("--window", type=int, default=64, help="local window in tokens")
    oval.add_argument("--entropy-window", default="16,128",
                      help="LO,HI: window range of the entropy policy (pick it so that its mean window is --window)")
    oval.add_argument("--module-window", default=None,
                      help="LO,HI: window range of the module policy (default: the range it was calibrated with)")
    oval.add_argument("--window-module", default=None,
                      help="a window module from `oval-edge calibrate`; adds the module policy")
    oval.add_argument("--reuse-tau", default=None,
                      help="comma-separated cosines, e.g. 0.9,0.95,0.99: one more oval row per value that reuses a "
                           "recent page selection when the query moved less (selection reuse, [R-reuse])")
    oval.add_argument("--group-pages", default=None,
                      help="comma-separated group sizes, e.g. 8,16: one more oval row per value that scores in two "
                           "levels (coarse groups of that many pages, then the pages of the best --top-groups)")
    oval.add_argument("--top-groups", type=int, default=OvalConfig.top_groups,
                      help="groups whose pages two-level rows score finely (default %(default)s)")
    oval.add_argument("--sink-pages", type=int, default=1, help="leading pages always attended")
    oval.add_argument("--dense-layers", type=int, default=2, help="first layers decoded densely")
    oval.add_argument("--rank", type=int, default=OvalConfig.rank, help="oval basis rank r (at most page_size - 1)")
    oval.add_argument("--record", default=OvalConfig.record, choices=RECORD_FORMATS,
                      help="how oval page records are stored: float (the pool's dtype, fp32 here), or quantized as "
                           "the pool keeps them")
    oval.add_argument("--kv-dtype", default="auto",
                      help="comma-separated K/V page storages to compare: auto (serve's default: bfloat16 on a CPU), "
                           "float32, bfloat16, float16, int8 (codes + an fp32 scale per token and KV head). Besides "
                           "float32, each gets its own pool of every policy's rows, all compared with one fp32 dense "
                           "reference")
    fid = parser.add_argument_group("fidelity (teacher-forced)")
    fid.add_argument("--text", default=None,
                     help="a UTF-8 text file (default: the model writes its own text from --seed); "
                          "tools/data/botchan_ch1-2.txt ships with the source")
    fid.add_argument("--length", type=int, default=1024, help="tokens of text evaluated")
    fid.add_argument("--start", type=int, default=None,
                     help="prefill positions 0..start-1 densely, decode the rest (default: length - 192)")
    fid.add_argument("--seed", type=int, default=0, help="seed of the generated text and of the passkeys")
    fid.add_argument("--save-text", default=None, help="write the generated text here")
    pk = parser.add_argument_group("passkey retrieval")
    pk.add_argument("--contexts", default="1024", help="comma-separated contexts in tokens, e.g. 2048,4096,8192")
    pk.add_argument("--depths", default="0.1,0.5,0.9", help="comma-separated needle depths in (0, 1)")
    pk.add_argument("--keys", type=int, default=2, help="passkeys per depth")
    pk.add_argument("--pool-memory", default="4GiB", help="K/V pool per passkey batch (more = more cases at once)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json_path", default=None, help="write the result rows as JSON here")
    out.add_argument("--plot", default=None, help="write a PNG: KL and retention vs tokens read per step")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is out of range: allowed [{low}, {high}]")


def _settings(args: argparse.Namespace) -> dict:
    """Validate every option before the model loads, so a typo costs nothing."""
    tasks = parse_names(args.tasks, "--tasks", TASKS)
    names = parse_names(args.policies, "--policies", ALL_POLICIES)
    if args.window_module and "module" not in names:
        names.append("module")
    windows = {"entropy": _window_range(args.entropy_window, "--entropy-window")}
    if "module" in names:
        if not args.window_module:
            raise ValueError("--policies module needs --window-module FILE (written by `oval-edge calibrate`)")
        from oval_edge.sparse.window_module import calibrated_window_range

        windows["module"] = (_window_range(args.module_window, "--module-window") if args.module_window
                             else calibrated_window_range(args.window_module))
    page_sizes = parse_int_list(args.page_size, "--page-size", 16, 256)
    top_ks = parse_int_list(args.top_k, "--top-k", 1, 4096)
    etas = parse_float_list(args.eta, "--eta", 0.0, 1.0)
    reuse_taus = _reuse_taus(args.reuse_tau, names)
    group_pages = parse_int_list(args.group_pages, "--group-pages", 2, 256) if args.group_pages else []
    if group_pages and "oval" not in names:
        raise ValueError("--group-pages adds oval rows that score in two levels: keep oval in --policies")
    _check_int("--threads", args.threads, 1, 1024)
    _check_int("--length", args.length, 16, 1 << 20)
    start = args.start if args.start is not None else max(1, args.length - 192)
    _check_int("--start", start, 1, args.length - 1)
    _check_int("--keys", args.keys, 1, 1000)
    _check_int("--prefill-chunk", args.prefill_chunk, 16, 65536)
    contexts = parse_int_list(args.contexts, "--contexts", 128, 1 << 20)
    depths = parse_float_list(args.depths, "--depths", 0.0, 1.0)
    bases = [OvalConfig(page_size=p, top_k=max(top_ks), sink_pages=args.sink_pages, window_min=args.window,
                        window_max=args.window, dense_layers=args.dense_layers, rank=args.rank, eta=etas[0],
                        record=args.record, kv_dtype="float32", top_groups=args.top_groups)
             for p in page_sizes]  # validates window, sink, rank, ...
    kv_dtypes = parse_names(args.kv_dtype, "--kv-dtype", EVAL_KV_DTYPES)
    dtypes = parse_names(args.dtype, "--dtype", EVAL_DTYPES)
    peers = parse_names(args.peers, "--peers", PEERS) if args.peers else []
    if args.text is not None and not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text} is not a file")
    return dict(tasks=tasks, policies=build_policies(names, top_ks, etas, windows, reuse_taus, group_pages),
                page_sizes=page_sizes, start=start, contexts=contexts, depths=depths, kv_dtypes=tuple(kv_dtypes),
                dtypes=dtypes,
                peers=peers,
                base=bases[0].replace(top_k=top_ks[0]),
                pool_memory=parse_bytes(args.pool_memory, "--pool-memory"))


def _reuse_taus(text: str | None, names: list[str]) -> list[float]:
    if text is None:
        return []
    taus = parse_float_list(text, "--reuse-tau", float("-inf"), float("inf"))
    bad = [t for t in taus if not 0.0 < t <= 1.0]
    if bad:
        raise ValueError(f"--reuse-tau={text!r}: {bad} out of range; allowed (0, 1] (1 = only an unchanged query)")
    if "oval" not in names:
        raise ValueError("--reuse-tau adds oval rows that reuse selections: keep oval in --policies")
    return taus


def _window_range(text: str, option: str) -> tuple[int, int]:
    values = parse_int_list(text, option, 3, 65536)
    if len(values) != 2 or values[0] >= values[1]:
        raise ValueError(f"{option}={text!r} must be LO,HI with 3 <= LO < HI, e.g. 16,128")
    return values[0], values[1]


def run(args: argparse.Namespace) -> int:
    s = _settings(args)
    torch.set_num_threads(args.threads)
    from .report import fidelity_table, passkey_table, write_json, write_plot

    began = time.perf_counter()
    models = load_models(args, s["dtypes"], s["kv_dtypes"])
    loaded = models[0][0]
    limit = loaded.config.max_position_embeddings
    too_long = [c for c in s["contexts"] + [args.length] if c > limit]
    if too_long:
        raise ValueError(f"{too_long} tokens exceed the model's context of {limit}; lower --length / --contexts")
    s["kv_dtypes"], s["others"] = models[0][1], models[1:]
    s["module"] = None
    if args.window_module:
        from oval_edge.sparse.window_module import load_module

        s["module"] = load_module(args.window_module, loaded.device, loaded.config, loaded.name)
        card = s["module"].card
        print(f"window module {args.window_module}: calibrated on {card.text}; held-out MAE "
              f"{card.fit.get('heldout', {}).get('mae_tokens', float('nan')):.1f} tokens, mean reach "
              f"{card.mean_reach:.3f}")
    base = s["base"]
    print(f"budget: window {args.window}, sink pages {args.sink_pages}, dense layers {args.dense_layers}, "
          f"rank {args.rank}; policies: {', '.join(p.label for p in s['policies'])}")
    records: list[dict] = []
    if "fidelity" in s["tasks"]:
        records += _fidelity(args, s, loaded, base)
        print(fidelity_table([r for r in records if r["task"] == "fidelity"]))
    if "passkey" in s["tasks"]:
        for model, kv_dtypes in models:  # each activation dtype's rows against its own dense rows
            pk = [rec | {"activations": dtype_name(model)}
                  for rec in _passkey(args, s | {"kv_dtypes": kv_dtypes}, model, base)]
            print(f"activations {dtype_name(model)}\n" if len(models) > 1 else "", passkey_table(pk), sep="")
            records += pk
    if args.json_path:
        write_json(args.json_path, records)
        print(f"wrote {len(records)} rows to {args.json_path}")
    if args.plot:
        write_plot(args.plot, records, f"{loaded.name} (weights {args.quant}), window {args.window}, "
                   f"sink {args.sink_pages}, dense layers {args.dense_layers}")
        print(f"wrote {args.plot}")
    print(f"eval took {time.perf_counter() - began:.0f} s")
    return 0


def _fidelity(args, s, loaded, base: OvalConfig) -> list[dict]:
    from .fidelity import run_fidelity
    from .report import fidelity_records
    from .text import encode_text, generate_text, read_text

    if args.text:
        text, source = read_text(args.text), args.text
    else:
        tic = time.perf_counter()
        text = generate_text(loaded, args.length + 64, args.seed, show_progress=not args.no_progress)
        source = f"text written by the model (seed {args.seed})"
        print(f"wrote a {len(text)}-character eval text in {time.perf_counter() - tic:.0f} s")
        if args.save_text:
            with open(args.save_text, "w", encoding="utf-8") as handle:
                handle.write(text)
    ids = encode_text(loaded.tokenizer, text, args.length, source)
    print(f"\nfidelity: {source}, {args.length} tokens, dense prefill 0..{s['start'] - 1}, "
          f"{args.length - s['start']} teacher-forced decode steps per row")
    rows = run_fidelity(loaded, ids, s["start"], base, s["policies"], s["page_sizes"], args.prefill_chunk,
                        show_progress=not args.no_progress, window_module=s["module"], kv_dtypes=s["kv_dtypes"],
                        others=tuple(s["others"]))
    return fidelity_records(rows) + _weights(args, s, loaded, ids, base, rows)


def _weights(args, s, loaded, ids: list[int], base: OvalConfig, rows) -> list[dict]:
    """The weights table (tools/eval/weights.py): served dense vs exact weights and the asked peers."""
    from .weights import exact_perplexity, llamacpp_perplexity, weights_records, weights_table

    activations = dtype_name(loaded)
    served = next(r.ppl for r in rows if r.policy.name == "dense" and r.kv_dtype == s["kv_dtypes"][-1]
                  and r.page_size == s["page_sizes"][0] and r.activations == activations)
    exact = None
    if loaded.quant != "none" and not args.no_exact:
        exact = exact_perplexity(args, ids, s["start"], base, s["page_sizes"][0], s["kv_dtypes"][-1], activations)
    peers = {}
    if "llama.cpp" in s["peers"]:
        if not loaded.source.gguf_file:
            raise ValueError("--peers llama.cpp needs a GGUF model; this one is a Hugging Face folder")
        peers["llama.cpp (f16 KV)"] = llamacpp_perplexity(loaded.source.path, ids, s["start"], args.threads)
    records = weights_records(loaded, served, exact, peers)
    print(weights_table(records, loaded.source.path))
    return records


def _passkey(args, s, loaded, base: OvalConfig) -> list[dict]:
    from .passkey import build_cases, run_passkey
    from .report import passkey_records
    from .runtime import geometry_for, groups_of

    results = []
    print(f"\npasskey: contexts {s['contexts']}, depths {s['depths']}, {args.keys} key(s) per depth, question fed "
          f"as decode steps, greedy answer")
    for page_size, kv_dtype in ((p, d) for p in s["page_sizes"] for d in s["kv_dtypes"]):
        config = base.replace(page_size=page_size, kv_dtype=kv_dtype)
        geometry = geometry_for(loaded.config, page_size, config.rank, record=config.record, kv_dtype=kv_dtype,
                                group_pages=groups_of(s["policies"]))
        for context in s["contexts"]:
            cases = build_cases(loaded.tokenizer, context, s["depths"], args.keys, args.seed)
            row_bytes = -(-(context + 8) // page_size) * geometry.bytes_per_page
            max_rows = max(len(s["policies"]), s["pool_memory"] // row_bytes)
            print(f"  context {context}, page {page_size}, K/V {kv_dtype}: {len(cases)} cases, up to {max_rows} rows "
                  f"({format_bytes(max_rows * row_bytes)}) per batch")
            results += run_passkey(loaded, cases, config, s["policies"], max_rows, args.prefill_chunk,
                                   show_progress=not args.no_progress, window_module=s["module"])
    return passkey_records(results)
