"""The parent side of `oval-edge bench`: prepare the prompts once, then run every job in a fresh child process.

The parent tokenizes the prompt with the model's tokenizer once per context and hands the same token ids to
every engine (llama.cpp gets ids, not text, so its own tokenizer cannot differ). Children are plain
`python -m oval_edge.tools.bench.worker` processes (not fork: a forked child would inherit the parent's
memory and its VmHWM would not be its own). Their stdout/stderr go to a log file; a failed or timed-out run
becomes a row with an `error` and the benchmark goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Callable

from .settings import (CONSTRAINED, BenchSettings, group_pages_of, passage_ids, prompt_length, reuse_tau_of,
                       schedule, warmup_ids)

WORKER_MODULE = "oval_edge.tools.bench.worker"


def load_tokenizer(model: str):
    """The tokenizer every engine's prompt is built with: the runtime's own (runtime.model.tokenizer.load_tokenizer)."""
    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer as runtime_tokenizer

    return runtime_tokenizer(resolve_model(model))


def build_prompts(tokenizer, contexts: tuple[int, ...], gen: int, max_positions: int | None) -> dict[int, list[int]]:
    """context -> prompt token ids (shortened only where prompt + gen would pass the model's positions)."""
    longest = max(prompt_length(c, gen, max_positions) for c in contexts)
    ids = passage_ids(tokenizer, longest)
    if len(ids) < longest:
        raise ValueError(f"the tokenizer produced {len(ids)} tokens for a {longest}-token prompt")
    return {c: ids[: prompt_length(c, gen, max_positions)] for c in contexts}


def job_spec(settings: BenchSettings, engine: str, context: int, run: int, prompt: list[int],
             kv_elements_per_token: dict) -> dict:
    return {
        "engine": engine, "context": context, "run": run, "prompt_ids": prompt, "warmup_ids": warmup_ids(prompt),
        "gen": settings.gen, "model": settings.model, "model_dir": settings.model_dir,
        "gguf_file": settings.gguf_file, "quant": settings.quant, "device": settings.device,
        "threads": settings.threads, "page_size": settings.page_size, "top_k": settings.top_k,
        "decode_step": settings.decode_step, "cuda_graphs": settings.cuda_graphs, "reuse_tau": reuse_tau_of(engine),
        "oval_from": settings.oval_from,
        "group_pages": group_pages_of(engine),
        "hf_dtype": settings.hf_dtype, "kv_elements_per_token": kv_elements_per_token,
        "schema": settings.schema if engine == CONSTRAINED else None,
    }


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(threads),  # the same thread count for torch's and llama.cpp's OpenMP pools
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",  # never reach for the network from a benchmark
        "TQDM_DISABLE": "1",  # transformers' GGUF conversion bar would fight the parent's progress bar
        "PYTHONUNBUFFERED": "1",
    })
    return env


def run_worker(job: dict, workdir: str, timeout_s: float) -> dict:
    """Run one job in a child process; return its result row (with `error` on any failure)."""
    stem = f"{job['engine'].replace('.', '')}-{job['context']}-{job['run']}"
    job_path, result_path = (os.path.join(workdir, f"{stem}.{kind}.json") for kind in ("job", "result"))
    log_path = os.path.join(workdir, f"{stem}.log")
    with open(job_path, "w", encoding="utf-8") as handle:
        json.dump({**job, "parent_pid": os.getpid()}, handle)  # the worker dies with this process (worker.py)
    base = {"engine": job["engine"], "context": job["context"], "run": job["run"]}
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run([sys.executable, "-m", WORKER_MODULE, job_path, result_path], stdout=log,
                                  stderr=subprocess.STDOUT, env=worker_env(job["threads"]), timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            return {**base, "error": f"timed out after {timeout_s:.0f} s (raise --timeout)"}
    if os.path.exists(result_path):
        with open(result_path, encoding="utf-8") as handle:
            result = json.load(handle)
        if proc.returncode == 0 or "error" in result:
            return result
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        tail = handle.read()[-600:].strip()
    return {**base, "error": f"worker exited with status {proc.returncode}: {tail}"}


def run_all(settings: BenchSettings, prompts: dict[int, list[int]], kv_elements_per_token: dict,
            progress: bool = True, worker: Callable[[dict, str, float], dict] = run_worker) -> list[dict]:
    """Every (engine, context, run) in alternating order; returns the per-run rows in that order."""
    from tqdm import tqdm

    order = schedule(settings.contexts, settings.engines, settings.runs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="oval-bench-") as workdir:
        bar = tqdm(order, desc="bench", unit="run", disable=not progress, dynamic_ncols=True)
        for engine, context, run in bar:
            bar.set_description(f"bench {engine} @ {context} (run {run + 1}/{settings.runs})")
            job = job_spec(settings, engine, context, run, prompts[context], kv_elements_per_token)
            row = worker(job, workdir, settings.timeout_s)
            rows.append(row)
            if "error" in row:
                bar.write(f"  {engine} @ {context} run {run + 1}: FAILED: {row['error']}")
            else:
                bar.set_postfix_str(f"last: {row.get('decode_tok_s') or 0:.1f} tok/s decode")
        bar.close()
    return rows
