"""The loss from weights, apart from the loss from OVAL.

eval's fidelity rows compare each policy with dense attention on the weights serve loads (`--quant auto`: a GGUF's
own blocks). That leaves out what the weights themselves cost, so eval also reports, on the same tokens and
positions, the dense perplexity of:
  exact     the file's weights dequantized to fp32 (`--quant none`): the ceiling for this file;
  served    the dense row of the fidelity table (the weights serve runs);
  llama.cpp the same GGUF in llama.cpp (llama-cpp-python, its f16 K/V), when `--peers llama.cpp` asks for it:
            what a user of the peer gets from the same file.
Perplexity is over the next tokens of positions start..N-2, as the fidelity rows compute it.
"""

from __future__ import annotations

import math
import os

import numpy as np

PEERS = ("llama.cpp",)


def exact_perplexity(args, ids: list[int], start: int, base, page_size: int, kv_dtype: str,
                     activations: str = "auto") -> float:
    """Dense perplexity with the exact weights (quant none), through the same teacher-forced runtime path, K/V
    storage and activation dtype as the served row, so the two differ by the weights alone."""
    from oval_edge.runtime.model.loader import load_model

    from .fidelity import run_fidelity
    from .policies import Policy

    exact = load_model(args.model, "none", args.device, activations)
    try:
        rows = run_fidelity(exact, ids, start, base, [Policy("dense")], [page_size], args.prefill_chunk,
                            show_progress=not args.no_progress, kv_dtypes=(kv_dtype,))
    finally:
        del exact
    return rows[-1].ppl  # the row in kv_dtype (a float32 reference row comes first for other storages)


def llamacpp_perplexity(gguf_path: str, ids: list[int], start: int, threads: int) -> float:
    """llama.cpp's perplexity of ids[start + 1:] given what precedes each, one evaluation of the whole text with
    every position's logits kept (llama-cpp-python, default f16 K/V, no BOS added: the same ids as ours)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=len(ids), n_batch=512, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        logits = np.asarray(llm.scores[start:len(ids) - 1], dtype=np.float64)  # [steps, vocab]: predicts pos + 1
    finally:
        llm.close()
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    targets = np.asarray(ids[start + 1:], dtype=np.int64)
    return math.exp(-float(logp[np.arange(len(targets)), targets].mean()))


def weights_records(loaded, served: float, exact: float | None, peers: dict[str, float]) -> list[dict]:
    """JSON rows of task 'weights': one per load compared, with its perplexity and its cost over exact."""
    def row(load: str, ppl: float) -> dict:
        return {"task": "weights", "policy": "dense", "load": load, "ppl": ppl,
                "vs_exact": None if exact is None else ppl / exact - 1.0}

    rows = [row(f"served ({loaded.quant})", served)]
    if exact is not None:
        rows.insert(0, row("exact (none)", exact))
    rows += [row(name, ppl) for name, ppl in peers.items()]
    return rows


def weights_table(records: list[dict], model_file: str) -> str:
    lines = [f"\nweights: dense perplexity of {os.path.basename(model_file)} as loaded (same tokens and positions)",
             f"  {'load':<26} {'perplexity':>10} {'vs exact':>9}"]
    for r in records:
        vs = "-" if r["vs_exact"] is None else f"{100 * r['vs_exact']:+.2f}%"
        lines.append(f"  {r['load']:<26} {r['ppl']:>10.3f} {vs:>9}")
    return "\n".join(lines)
