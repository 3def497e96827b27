"""Teacher-forced fidelity: how far each policy's next-token distributions drift from dense attention.

Positions 0..start-1 are prefilled densely once; their K/V are copied into every row (one row per policy and
budget, plus the dense reference row). Then the true tokens start..N-1 are fed one per decode step to all rows
together. Each row keeps its own cache, so a policy's errors propagate into its later layers and steps exactly
as they would while serving. Per row: mean KL(dense || policy) over the N - start steps, top-1 agreement with
dense, and the perplexity of the true next tokens (steps start..N-2).

kv_dtypes (`--kv-dtype`): with the default ['float32'] every row shares one fp32 pool. Other K/V storages (bfloat16,
int8, ...) each get a pool of their own holding every policy's rows, decoded in lockstep with a reference pool
that holds the dense row in fp32: every row, of every storage, is compared with that one full-precision
reference, so the rows of two storages at equal pages differ only by the storage.

others (`--dtype float32,bfloat16`): the same model loaded with other activation dtypes, each with its K/V storages:
their pools join the lockstep beside the first model's, their prefix computed by their own model (CUDA's bf16
prefill included), so every row is still compared with the one reference (dense, the first model's activations,
fp32 K/V). kl_own is each row's KL from the dense row of its own pool (same activations, same storage): OVAL's cost
inside one dtype, apart from what the dtype itself costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from oval_edge.config import OvalConfig

from .policies import Policy
from .runtime import (EvalRunner, allocate_row, dense_prefix, ensure_output_metric, eval_pool, geometry_for, groups_of,
                      load_kv)


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
    kv_dtype: str = "float32"  # the K/V storage of the row's pool (the reference is always fp32)
    activations: str = "float32"  # the row's model's activation dtype (module doc: others)
    kl_own: float | None = None  # mean KL from the dense row of its own pool (module doc)


@torch.no_grad()
def run_fidelity(loaded, ids: list[int], start: int, base: OvalConfig, policies: list[Policy],
                 page_sizes: list[int], chunk: int = 512, show_progress: bool = True,
                 window_module=None, kv_dtypes: tuple[str, ...] = ("float32",),
                 others: tuple = ()) -> list[FidelityRow]:
    """One pass per page size; every pass starts from the same dense prefix (computed once per model). `window_module`:
    the calibrated module the `module` policy rows decode with; kv_dtypes: the K/V storages compared (above); others:
    (LoadedModel, kv_dtypes) of the same model with other activation dtypes (above)."""
    total = len(ids)
    if not 1 <= start < total:
        raise ValueError(f"--start={start} must be in [1, {total - 1}] for a text of {total} tokens")
    if policies[0].name != "dense":
        raise ValueError("the first row must be the dense reference")
    models = [(loaded, tuple(kv_dtypes)), *others]
    # [layers, start, Hkv, D] each, per model: its own dense prefill of the prefix
    prefixes = [dense_prefix(m.model, ids[:start], min(page_sizes), base.rank, m.device, chunk)[:2] for m, _ in models]
    lanes = [(loaded, prefixes[0], "float32", policies)] if not others and list(kv_dtypes) == ["float32"] else \
        [(loaded, prefixes[0], "float32", policies[:1])] + [
            (m, prefix, dtype, policies) for (m, dtypes), prefix in zip(models, prefixes) for dtype in dtypes]
    rows: list[FidelityRow] = []
    for page_size in page_sizes:
        rows += _one_pass(ids, start, base.replace(page_size=page_size), lanes, show_progress, window_module)
    return rows


def _lane(loaded, config: OvalConfig, kv_dtype: str, policies, prefix, total: int, window_module):
    """(pool, runner) of one K/V storage with a row per policy, each holding the dense prefix."""
    count, page_size = len(policies), config.page_size
    keys, values = prefix  # [layers, start, Hkv, D] each
    config = config.replace(kv_dtype=kv_dtype)
    geometry = geometry_for(loaded.config, page_size, config.rank, record=config.record, kv_dtype=kv_dtype,
                            group_pages=groups_of(policies))
    pool = eval_pool(geometry, count * -(-total // page_size), loaded.device, eta=config.eta,
                    stage_pages=count + -(-keys.shape[1] // page_size) + 1)  # int8: the prefix load + open pages
    runner = EvalRunner(loaded.model, pool, config, policies, window_module)
    ensure_output_metric(pool, runner, policies)
    for row, policy in enumerate(policies):
        allocate_row(pool, row, total, policy.summary_eta())
        load_kv(pool, row, keys, values)
    return pool, runner


def _one_pass(ids, start, config: OvalConfig, lanes, show_progress, window_module=None) -> list[FidelityRow]:
    """lanes: (model, prefix, kv dtype, policies) per pool; the first lane's first row (dense) is the reference of
    every row, and each lane's first row (dense) the reference of its kl_own."""
    total, page_size = len(ids), config.page_size
    built = [_lane(m, config, dtype, policies, prefix, total, window_module) for m, prefix, dtype, policies in lanes]
    count = sum(len(lane[3]) for lane in lanes)
    own = torch.tensor([first for first, lane in zip(_starts(lanes), lanes) for _ in lane[3]])  # [rows] own dense
    kl = torch.zeros(count, dtype=torch.float64)
    kl_own = torch.zeros(count, dtype=torch.float64)
    agree = torch.zeros(count, dtype=torch.long)
    nll = torch.zeros(count, dtype=torch.float64)
    targets = torch.tensor(ids, dtype=torch.long)
    steps = range(start, total)
    bar = tqdm(steps, desc=f"fidelity P={page_size} ({count} rows)", unit="step", disable=not show_progress,
               leave=False)
    for pos in bar:
        logps = []
        for (*_, policies), (pool, runner) in zip(lanes, built):
            step = pool.prepare(list(range(len(policies))), [1] * len(policies))
            logits, _ = runner.forward(step, targets[pos].repeat(len(policies)), decode=True)
            pool.commit(step)
            logps.append(torch.log_softmax(logits.double().cpu(), dim=-1))  # [rows, V]
        logp = torch.cat(logps)
        ref = logp[0]
        kl += (ref.exp()[None] * (ref[None] - logp)).sum(-1)
        kl_own += (logp[own].exp() * (logp[own] - logp)).sum(-1)
        agree += (logp.argmax(-1) == ref.argmax()).long()
        if pos + 1 < total:
            nll -= logp[:, targets[pos + 1]]
    bar.close()
    n = total - start
    scored = max(n - 1, 1)
    out = []
    rows = [(m, dtype, policy, pool, runner, i) for (m, _, dtype, policies), (pool, runner) in zip(lanes, built)
            for i, policy in enumerate(policies)]
    if len(lanes) > 1:  # the reference lane's dense row is reported with its lane's own dense row beside it
        rows = rows[1:]
        kl, kl_own, agree, nll = kl[1:], kl_own[1:], agree[1:], nll[1:]
    for row, (model, kv_dtype, policy, pool, runner, i) in enumerate(rows):
        layer_steps = int(runner.sparse_layer_steps[i])
        per_head = layer_steps * pool.geometry.kv_heads
        attended = float(runner.reads[i]) / per_head if layer_steps else None
        window = float(runner.window_sum[i]) / per_head if layer_steps else None
        out.append(FidelityRow(
            policy=policy, page_size=page_size, tokens_per_step=policy.tokens_per_step(config),
            tokens_attended=attended, window_mean=window, context=total, steps=n,
            kl=max(float(kl[row]) / n, 0.0), top1=float(agree[row]) / n,
            ppl=math.exp(float(nll[row]) / scored) if n > 1 else float("nan"),
            reuse=_reuse_summary(runner.reuse_counts(i)), kv_dtype=kv_dtype,
            activations=str(model.dtype).removeprefix("torch."), kl_own=max(float(kl_own[row]) / n, 0.0),
        ))
    return out


def _starts(lanes) -> list[int]:
    """The batch index of each lane's first row (its dense row) among all lanes' rows, in lane order."""
    starts, first = [], 0
    for lane in lanes:
        starts.append(first)
        first += len(lane[3])
    return starts


def _reuse_summary(counts) -> dict | None:
    if counts is None:
        return None
    return {"hit_rate": counts.hit_rate, "head_hit_rate": counts.head_hit_rate, "lookups": counts.lookups}
