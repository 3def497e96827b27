"""`oval-edge store-check`: does the page store change what the model computes? (issue #23)

Two engines share one loaded model: one whose pool holds the whole context, one whose pool holds `--pool-tokens`
with the rest in a page store on disk. Both run the eager forward without prefix caching, so they do the same
arithmetic on the same bytes; only where pages live differs. It reports
    logits   teacher-forced over positions [--start, --length): max |difference| and argmax agreement
    served   one greedy request of --length tokens through the engines' own steps: identical tokens, decode tok/s
             of each (and of the default in-memory static step), and bytes read from disk per decode step
    passkey  passkeys hidden at --depths in --length tokens (tools/eval/passkey.py's prompts): answers per case
    io       preadv against mmap + madvise for a recall's reads, on a second file in the same folder (io_compare.py)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from oval_edge.units import format_bytes, parse_bytes

TASKS = ("logits", "served", "passkey", "io")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--model", default="default", help="a .gguf file, a Hugging Face folder, or 'default'")
    parser.add_argument("--quant", default="auto", help="weights, as serve loads them")
    parser.add_argument("--pool-tokens", type=int, default=2048, help="tokens the in-memory pool holds")
    parser.add_argument("--kv-store", default=None,
                        help="folder for the store file (default: a temporary folder under the current directory; "
                             "it must be on a drive, not tmpfs)")
    parser.add_argument("--kv-store-size", default="1GiB", help="size of the store file")
    parser.add_argument("--text", default="tools/data/botchan_ch1-2.txt", help="text of the long request")
    parser.add_argument("--length", type=int, default=8192, help="tokens of the long request (the model's limit)")
    parser.add_argument("--start", type=int, default=6144, help="first teacher-forced position")
    parser.add_argument("--served-tokens", type=int, default=64, help="greedy tokens of the served request")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="passkey depths")
    parser.add_argument("--keys", type=int, default=1, help="passkeys per depth")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated: {', '.join(TASKS)}")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    from oval_edge.config import OvalConfig
    from oval_edge.runtime.engine.engine import Engine
    from oval_edge.runtime.engine.setup import EngineConfig
    from oval_edge.runtime.model.loader import load_model

    from . import runs

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = sorted(set(tasks) - set(TASKS))
    if bad:
        raise ValueError(f"--tasks {bad} unknown; allowed: {', '.join(TASKS)}")
    if not 0 < args.start < args.length:
        raise ValueError(f"--start {args.start} must be inside (0, --length {args.length})")
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.kv_store or tempfile.mkdtemp(prefix="oval-store-check-", dir=os.getcwd())
    loaded = load_model(args.model, args.quant, "cpu")
    limit = min(args.length, loaded.config.max_position_embeddings)
    oval = OvalConfig()
    common = dict(max_batch=1, max_model_len=limit, prefix_cache=False)
    memory = Engine(loaded, oval, EngineConfig(decode_step="eager", **common))
    store = Engine(loaded, oval, EngineConfig(decode_step="eager", pool_tokens=args.pool_tokens, kv_store=folder,
                                              kv_store_size=parse_bytes(args.kv_store_size, "--kv-store-size"),
                                              **common))
    tier = store.pool.store
    figures: dict = {"model": loaded.name, "quant": args.quant, "oval": oval.to_dict(),
                     "pool_tokens": store.pool.resident_tokens, "memory_pool_tokens": memory.pool.resident_tokens,
                     "store": tier.store.describe(), "store_read_bytes_per_s": tier.store.read_throughput,
                     "recall_pages": tier.recall_pages, "mirror_bytes": tier.mirror.nbytes()}
    print(f"store-check: in memory {memory.pool.resident_tokens} tokens | with the store: {store.pool.resident_tokens} "
          f"tokens in memory + {tier.blocks * store.pool.page_size} in {tier.store.describe()}; drive read "
          f"{format_bytes(int(tier.store.read_throughput or 0))}/s; {tier.recall_pages} recall frames per layer; "
          f"dense layers' mirror {format_bytes(tier.mirror.nbytes())}", flush=True)
    ids = loaded.tokenizer(open(args.text, encoding="utf-8").read())["input_ids"][:limit]
    if len(ids) < limit:
        raise ValueError(f"{args.text} has {len(ids)} tokens, fewer than --length {limit}")
    if "logits" in tasks:
        began = time.perf_counter()
        tf = runs.teacher_forced(memory, store, ids, args.start)
        figures["logits"] = tf.__dict__ | {"wall_s": time.perf_counter() - began}
        print(f"logits   positions {tf.positions[0]}-{tf.positions[1]}: max |diff| {tf.max_abs_diff:.3g}, argmax "
              f"agrees {tf.argmax_agree}/{tf.steps}; decode {tf.steps - 1} steps: in memory "
              f"{(tf.steps - 1) / tf.seconds['memory']:.2f} tok/s, with the store "
              f"{(tf.steps - 1) / tf.seconds['store']:.2f} tok/s", flush=True)
    if "served" in tasks:
        prompt = ids[: limit - args.served_tokens]
        static = Engine(loaded, oval, EngineConfig(**common))  # the default decode step, for the speed baseline
        rows = {"memory (static step)": runs.served(static, prompt, args.served_tokens)}
        del static
        rows["memory (eager)"] = runs.served(memory, prompt, args.served_tokens)
        counted = ("recall_hits", "recall_misses", "transient_reads", "mirror_reads")
        before = [getattr(tier.stats, name) for name in counted]
        rows["store (eager)"] = runs.served(store, prompt, args.served_tokens)
        hits, misses, transient, mirrored = (getattr(tier.stats, name) - then for name, then in zip(counted, before))
        same = rows["memory (eager)"].output_ids == rows["store (eager)"].output_ids
        figures["served"] = {name: r.__dict__ | {"tokens_per_second": r.tokens_per_second} for name, r in rows.items()}
        figures["served"]["identical"] = same
        figures["served"]["store_recalls"] = {"hits": hits, "misses": misses, "transient": transient,
                                             "mirror": mirrored}
        steps = rows["store (eager)"].decode_steps
        for name, r in rows.items():
            print(f"served   {name:<22} {r.tokens_per_second:6.2f} tok/s over {r.decode_steps} steps"
                  + (f"; disk {format_bytes(r.disk_bytes // max(steps, 1))}/step" if r.disk_bytes else ""), flush=True)
        base = rows["memory (static step)"].tokens_per_second
        print(f"served   greedy tokens identical: {same}; store / in-memory static: "
              f"{rows['store (eager)'].tokens_per_second / base:.2f}x; recalls: {hits} hits, {misses} misses, "
              f"{transient} page-layers read from disk for wide reads (prompt chunks over the stored history), "
              f"{mirrored} dense-layer reads served by the in-memory mirror", flush=True)
    if "passkey" in tasks:
        from oval_edge.tools.eval.passkey import ANSWER_TOKENS, build_cases

        depths = [float(d) for d in args.depths.split(",")]
        cases = build_cases(loaded.tokenizer, limit - ANSWER_TOKENS, depths, args.keys, seed=0)
        answers = {name: runs.passkeys(engine, cases, loaded.tokenizer, ANSWER_TOKENS)
                   for name, engine in (("memory", memory), ("store", store))}
        figures["passkey"] = answers
        for name, rows in answers.items():
            print(f"passkey  {name:<7} {sum(r[3] for r in rows)}/{len(rows)}: "
                  + ", ".join(f"{d}:{'ok' if ok else repr(text)}" for d, _, text, ok in rows), flush=True)
        print(f"passkey  answers identical case for case: "
              f"{[r[2] for r in answers['memory']] == [r[2] for r in answers['store']]}", flush=True)
    if "io" in tasks:
        from .io_compare import compare, report

        blocks = max(1, (256 << 20) // tier.store.block_bytes)  # 256 MiB: far more blocks than one pass touches
        figures["io"] = compare(folder, tier.store.layer_bytes, tier.store.layers, blocks, batches=400,
                                pages_per_batch=4)
        print(report(figures["io"]), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2, default=str)
    tier.store.close()
    if args.kv_store is None:
        os.rmdir(folder)
    return 0
