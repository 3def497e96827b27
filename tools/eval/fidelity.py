"""Teacher-forced fidelity: how far each policy's next-token distributions drift from dense attention.

Positions 0..start-1 are prefilled densely once; their K/V are copied into every row (one row per policy and
budget, plus the dense reference row). Then the true tokens start..N-1 are fed one per decode step to all rows
together. Each row keeps its own cache, so a policy's errors propagate into its later layers and steps exactly
as they would while serving. Per row: mean KL(dense || policy) over the N - start steps, top-1 agreement with
dense, and the perplexity of the true next tokens (steps start..N-2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from oval_edge.config import OvalConfig

from .policies import Policy
from .runtime import EvalPool, EvalRunner, dense_prefix, ensure_output_metric, geometry_for, groups_of, load_kv


@dataclass
class FidelityRow:
    policy: Policy
    page_size: int
    tokens_per_step: int | None  # configured K/V slots per KV head in a sparse layer (None: dense)
    tokens_attended: float | None  # measured mean valid slots per KV head per sparse layer-step
    window_mean: float | None  # measured mean window length (tokens) per KV head per sparse layer-step
    context: int  # text length N
    steps: int  # decode steps compared (N - start)
    kl: float
    top1: float
    ppl: float
    reuse: dict | None = None  # rows with a reuse_tau: {"hit_rate", "head_hit_rate", "lookups"} (tools/eval/reuse)


@torch.no_grad()
def run_fidelity(loaded, ids: list[int], start: int, base: OvalConfig, policies: list[Policy],
                 page_sizes: list[int], chunk: int = 512, show_progress: bool = True,
                 window_module=None) -> list[FidelityRow]:
    """One pass per page size; every pass starts from the same dense prefix (computed once). `window_module`:
    the calibrated module the `module` policy rows decode with."""
    total = len(ids)
    if not 1 <= start < total:
        raise ValueError(f"--start={start} must be in [1, {total - 1}] for a text of {total} tokens")
    if policies[0].name != "dense":
        raise ValueError("the first row must be the dense reference")
    model = loaded.model
    keys, values, _ = dense_prefix(model, ids[:start], min(page_sizes), base.rank, loaded.device, chunk)
    rows: list[FidelityRow] = []
    for page_size in page_sizes:
        config = base.replace(page_size=page_size)
        rows += _one_pass(loaded, ids, start, config, policies, keys, values, show_progress, window_module)
    return rows


def _one_pass(loaded, ids, start, config: OvalConfig, policies, keys, values, show_progress,
              window_module=None) -> list[FidelityRow]:
    total, count, page_size = len(ids), len(policies), config.page_size
    pages_per_row = -(-total // page_size)
    pool = EvalPool(geometry_for(loaded.config, page_size, config.rank, record=config.record,
                                 group_pages=groups_of(policies)), count * pages_per_row,
                    loaded.device, eta=config.eta)
    runner = EvalRunner(loaded.model, pool, config, policies, window_module)
    ensure_output_metric(pool, runner, policies)
    for row, policy in enumerate(policies):
        pool.allocate_row(row, total, policy.summary_eta())
        load_kv(pool, row, keys, values)
    seq_ids = list(range(count))
    kl = torch.zeros(count, dtype=torch.float64)
    agree = torch.zeros(count, dtype=torch.long)
    nll = torch.zeros(count, dtype=torch.float64)
    targets = torch.tensor(ids, dtype=torch.long)
    steps = range(start, total)
    bar = tqdm(steps, desc=f"fidelity P={page_size} ({count} rows)", unit="step", disable=not show_progress,
               leave=False)
    for pos in bar:
        step = pool.prepare(seq_ids, [1] * count)
        logits, _ = runner.forward(step, targets[pos].repeat(count), decode=True)
        pool.commit(step)
        logp = torch.log_softmax(logits.double().cpu(), dim=-1)  # [rows, V]
        ref = logp[0]
        kl += (ref.exp()[None] * (ref[None] - logp)).sum(-1)
        agree += (logp.argmax(-1) == ref.argmax()).long()
        if pos + 1 < total:
            nll -= logp[:, targets[pos + 1]]
    bar.close()
    n = total - start
    scored = max(n - 1, 1)
    out = []
    for row, policy in enumerate(policies):
        layer_steps = int(runner.sparse_layer_steps[row])
        per_head = layer_steps * pool.geometry.kv_heads
        attended = float(runner.reads[row]) / per_head if layer_steps else None
        window = float(runner.window_sum[row]) / per_head if layer_steps else None
        out.append(FidelityRow(
            policy=policy, page_size=page_size, tokens_per_step=policy.tokens_per_step(config),
            tokens_attended=attended, window_mean=window, context=total, steps=n,
            kl=max(float(kl[row]) / n, 0.0), top1=float(agree[row]) / n,
            ppl=math.exp(float(nll[row]) / scored) if n > 1 else float("nan"),
            reuse=_reuse_summary(runner.row_reuse.counts(row)),
        ))
    return out


def _reuse_summary(counts) -> dict | None:
    if counts is None:
        return None
    return {"hit_rate": counts.hit_rate, "head_hit_rate": counts.head_hit_rate, "lookups": counts.lookups}
