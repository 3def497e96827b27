"""The runtime pieces `oval-edge eval` drives: a pool that seals each row with its own eta, a PagedLlama that
decodes every policy of a pass as rows of one batch, the oracle page scorer, and K/V copying between sequences.

One forward per teacher-forced step serves all policies: the weights (the bulk of a CPU decode step) are read
once for the whole batch. Rows are grouped by the OvalConfig they decode with (dense / window per budget / scored
per budget); a scored group holds quest, oval (any eta) and oracle rows, which differ only in their page scores.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from oval_edge.config import OvalConfig
from oval_edge.geometry import KVGeometry, kv_dims
from oval_edge.kv.pool import PagePool
from oval_edge.kv.step_index import StepIndex
from oval_edge.kv.summaries import seal_pages
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
from oval_edge.sparse.attention import decode_attention, decode_plan, flat_slots, gather_kv, gather_rows
from oval_edge.sparse.scoring import group_queries, score_pages
from oval_edge.sparse.selection import Selection

from .policies import Policy
from .reuse import EvalReuse


def geometry_for(model_config, page_size: int, rank: int, kinds=("oval", "quest"), record: str = "float",
                 kv_dtype: str = "float32", group_pages: int = 0) -> KVGeometry:
    """A pool geometry for the eval's pools (both summaries by default: rows of either scorer share it); record:
    how the oval records are stored (page_record.py); kv_dtype: the K/V storage (int8: summaries stay fp32);
    group_pages: coarse records for two-level rows (grouped.py)."""
    config = OvalConfig(page_size=page_size, rank=rank, record=record, kv_dtype=kv_dtype, group_pages=group_pages)
    return KVGeometry.for_oval(*kv_dims(model_config), config, "float32" if kv_dtype == "int8" else kv_dtype, kinds)


def groups_of(policies) -> int:
    """The coarse group size a pool needs for these rows (two-level oval rows; 0: none)."""
    return max((p.group_pages for p in policies), default=0)


def ensure_output_metric(pool: PagePool, runner, policies) -> None:
    """Rows sealed with eta > 0 weigh values by the output projection's metric: give the pool the model's."""
    if pool.output_metric is None and any((p.summary_eta() or 0.0) > 0 for p in policies):
        pool.set_output_metric(runner.output_metrics())


class RowEtas:
    """The eval pool's sealer (PagePool.sealer): oval rows with several etas share one pool, so each page is sealed
    with the eta of the row that owns it (allocate_row records it); pages of rows that never read an oval summary
    get only the cheap quest summary. A call that names an eta seals with it."""

    def __init__(self, eta: float) -> None:
        self.eta = float(eta)
        self.page_eta: dict[int, float | None] = {}

    def __call__(self, pool: PagePool, pages: Sequence[int], eta: float | None = None, kinds=None) -> None:
        if eta is not None:
            return seal_pages(pool, pages, float(eta), kinds)
        by_eta: dict[float, list[int]] = defaultdict(list)
        plain: list[int] = []
        for page in pages:
            page_eta = self.page_eta.get(page, self.eta)
            (plain if page_eta is None else by_eta[page_eta]).append(page)
        for page_eta, group in by_eta.items():
            seal_pages(pool, group, page_eta, kinds)
        if plain:
            seal_pages(pool, plain, self.eta, ("quest",))


def eval_pool(geometry: KVGeometry, num_pages: int, device="cpu", eta: float = 0.0,
              stage_pages: int | None = None) -> PagePool:
    """A PagePool whose pages are sealed per row (RowEtas); rows join it through allocate_row."""
    pool = PagePool(geometry, num_pages, device, eta=eta, stage_pages=stage_pages)
    pool.sealer = RowEtas(eta)
    return pool


def allocate_row(pool: PagePool, seq_id, num_tokens: int, eta: float | None) -> None:
    """Pages for one eval row whose sealed pages take `eta` (None: the quest summary only); ValueError if full."""
    pages = pool.allocate(seq_id, num_tokens)
    if pages is None:
        raise ValueError(f"the eval pool ({pool.num_pages} pages) cannot hold {num_tokens} more tokens")
    pool.sealer.page_eta.update(dict.fromkeys(pages, eta))


def oracle_page_scores(pool: PagePool, layer: int, page_table: torch.Tensor, lengths: torch.Tensor,
                       q: torch.Tensor, scale: float) -> torch.Tensor:
    """True log attention mass of every page: logsumexp over its tokens and the group's query heads of scale*q.k.

    Reads every cached key (allowed for this reference policy only). page_table [b, Np]; lengths [b];
    q [b, Hq, D] -> [b, Hkv, Np] (-inf for pages past the end).
    """
    g = pool.geometry
    b, num_pages = page_table.shape
    positions = torch.arange(num_pages * g.page_size, device=q.device).expand(b, g.kv_heads, -1)
    idx = flat_slots(page_table, positions, g.kv_heads, g.page_size).reshape(-1)
    keys = gather_rows(pool.k_rows[layer], pool.v_rows[layer], idx, pool.scale_rows[layer])[0].view(
        *positions.shape, g.head_dim)  # int8 pools: the keys dequantized
    grouped = group_queries(q, g.kv_heads).to(keys.dtype)  # [b, Hkv, G, D]
    logits = scale * torch.einsum("bhgd,bhtd->bhgt", grouped, keys).float()  # [b, Hkv, G, Np*P]
    logits = logits.masked_fill(positions[:, :, None, :] >= lengths[:, None, None, None], float("-inf"))
    pages = logits.view(b, g.kv_heads, -1, num_pages, g.page_size)
    return torch.logsumexp(pages.transpose(2, 3).flatten(-2), dim=-1)  # [b, Hkv, Np]


@dataclass
class RowGroup:
    rows: torch.Tensor  # [n] batch rows of this group
    row_list: list[int]
    config: OvalConfig
    kind: str  # 'dense', 'window' or 'scored'
    by_scorer: dict[str, torch.Tensor]  # scorer -> positions within the group (scored groups only)


class EvalRunner(PagedLlama):
    """PagedLlama whose decode layers dispatch each row group to decode_attention with that group's config.

    row_policies[b] is the policy of batch row b; every step must list the rows in that order.
    `reads` accumulates, per row, the K/V slots attended in sparse layers (summed over KV heads), `window_sum`
    the window lengths (summed over KV heads). Rows of the `module` policy take their windows from
    `window_module` (a calibrated OutputAwareModule) through the runtime's window hook; every decode layer goes
    through `decode_rows`, the runtime's layer hook.
    """

    def __init__(self, hf_model, pool: PagePool, base: OvalConfig, row_policies: Sequence[Policy],
                 window_module=None):
        super().__init__(hf_model, pool, base, attention="oval")
        self.row_policies = list(row_policies)
        keys: dict[tuple, list[int]] = defaultdict(list)
        for row, policy in enumerate(self.row_policies):
            keys[policy.group_key()].append(row)
        self.groups: list[RowGroup] = []
        for rows in keys.values():
            first = self.row_policies[rows[0]]
            by_scorer: dict[str, list[int]] = defaultdict(list)
            for i, row in enumerate(rows):
                by_scorer[self.row_policies[row].scorer].append(i)
            self.groups.append(RowGroup(
                torch.tensor(rows, dtype=torch.long, device=pool.device), rows, first.config(base),
                first.group_key()[0],
                {s: torch.tensor(i, dtype=torch.long, device=pool.device) for s, i in by_scorer.items()},
            ))
        self.reads = torch.zeros(len(self.row_policies), dtype=torch.float64)
        self.window_sum = torch.zeros(len(self.row_policies), dtype=torch.float64)
        ranges = {p.window for p in self.row_policies if p.name == "module"}
        if ranges:
            from oval_edge.sparse.window_module import WindowHook

            if window_module is None:
                raise ValueError("the module policy needs a calibrated window module (--window-module FILE)")
            if len(ranges) > 1:
                raise ValueError(f"module rows must share one window range, got {sorted(ranges)}")
            lo, hi = ranges.pop()
            self.hooks.window = WindowHook(window_module, lo, hi)  # windows of every row; module rows use them
        self.sparse_layer_steps = torch.zeros(len(self.row_policies), dtype=torch.long)
        # Oval rows with a reuse_tau keep recent selections (tools/eval/reuse.py); no-op without such rows.
        self.row_reuse = EvalReuse(self.groups, self.row_policies, len(self.layers), self.num_heads, self.kv_heads,
                                   self.head_dim, pool.device)
        self._cached: tuple[StepIndex, list] | None = None
        self.hooks.layer = self.decode_rows

    def _substeps(self, step: StepIndex) -> list:
        """(sub-step, decode plan) of every group, built once per step and shared by all layers."""
        if len(step.seq_ids) != len(self.row_policies):
            raise ValueError(f"step has {len(step.seq_ids)} rows, the runner was built for {len(self.row_policies)}")
        if self._cached is None or self._cached[0] is not step:
            subs = [slice_step(step, g.row_list, g.rows) for g in self.groups]
            plans = [decode_plan(self.pool, sub, g.config) for sub, g in zip(subs, self.groups)]
            self._cached = (step, list(zip(subs, plans)))
        return self._cached[1]

    def decode_rows(self, index: int, step: StepIndex, q: torch.Tensor, _runtime_plan, window, _dense):
        """hooks.layer: every row group decodes the layer with its own config, plan and scorer.

        The runtime's own plan and dense flag (built for the base config over all rows) are not used: each group has
        its own. window [B, Hkv]: the module's windows for every row (None without module rows), used by module rows.
        """
        out = torch.empty_like(q)
        b, kv_heads = q.shape[0], self.kv_heads
        parts: list[tuple[torch.Tensor, Selection]] = []
        for group, (sub, plan) in zip(self.groups, self._substeps(step)):
            q_group = q.index_select(0, group.rows)
            dense = group.kind == "dense" or index < group.config.dense_layers
            scores = None if dense else self._group_scores(group, index, sub, q_group)
            rows_window = window.index_select(0, group.rows) if window is not None and group.kind == "module" else None
            reused = self.row_reuse.apply(group, index, sub, plan, q_group, scores)
            o, sel = decode_attention(self.pool, index, sub, q_group, group.config, self.scale, dense=dense,
                                      scores=scores, plan=plan, window=rows_window)
            self.row_reuse.record(reused, sel)
            out.index_copy_(0, group.rows, o)
            parts.append((group.rows, sel))
            if not dense:
                self.reads.index_add_(0, group.rows.cpu(), sel.valid.sum((1, 2)).double().cpu())
                self.sparse_layer_steps[group.rows.cpu()] += 1
                if sel.window is not None:
                    used = sel.window * sel.sparse_rows[:, None]  # [n, Hkv]; dense (short) rows have none
                    self.window_sum.index_add_(0, group.rows.cpu(), used.sum(1).double().cpu())
        # One Selection for the runner's statistics: every group's slots, padded to the widest group.
        width = max(sel.slots for _, sel in parts)
        valid = torch.zeros(b, kv_heads, width, dtype=torch.bool, device=q.device)
        sparse_rows = torch.zeros(b, dtype=torch.bool, device=q.device)
        for rows, sel in parts:
            valid[rows, :, : sel.slots] = sel.valid
            sparse_rows[rows] = sel.sparse_rows
        return out, Selection(torch.zeros_like(valid, dtype=torch.long), valid, None, None, sparse_rows)

    def _group_scores(self, group: RowGroup, layer: int, sub: StepIndex, q: torch.Tensor) -> torch.Tensor:
        """Page scores [n, Hkv, Np] for a group: each row scored by its own policy's scorer."""
        if group.kind == "window":
            # Window rows select no page (top_k = 0): constant scores skip the scorer they never use.
            return torch.zeros(q.shape[0], self.kv_heads, sub.page_table.shape[1], device=q.device)
        scores = torch.empty(q.shape[0], self.kv_heads, sub.page_table.shape[1], device=q.device)
        for scorer, idx in group.by_scorer.items():
            table = sub.page_table.index_select(0, idx)
            q_rows = q.index_select(0, idx)
            if scorer == "oracle":
                s = oracle_page_scores(self.pool, layer, table, sub.lengths.index_select(0, idx), q_rows, self.scale)
            else:  # 'oval:G': two-level scoring with groups of G pages
                name, _, size = scorer.partition(":")
                groups = (int(size), self.config.top_groups) if size else (0, 0)
                s = score_pages(name, group_queries(q_rows, self.kv_heads), self.pool.summaries, layer, table,
                                self.scale, sealed=sub.sealed.index_select(0, idx), groups=groups)
            scores.index_copy_(0, idx, s.float())
        return scores


def slice_step(step: StepIndex, rows: list[int], rows_t: torch.Tensor) -> StepIndex:
    """The StepIndex of a subset of rows of a decode step (one new token per row, so token index == row)."""
    return StepIndex(
        seq_ids=[step.seq_ids[r] for r in rows],
        new_tokens=[step.new_tokens[r] for r in rows],
        positions=step.positions.index_select(0, rows_t),
        token_row=torch.arange(len(rows), device=rows_t.device),
        write_base=step.write_base.index_select(0, rows_t),
        page_table=step.page_table.index_select(0, rows_t),
        lengths=step.lengths.index_select(0, rows_t),
        sealed=step.sealed.index_select(0, rows_t),
        lengths_list=[step.lengths_list[r] for r in rows],
    )


# ---- K/V of a prefix: computed once densely, copied into every row -------------------------------------------

def capture_kv(pool: PagePool, seq_id, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0..length-1 of a sequence: -> k, v [layers, length, Hkv, D]."""
    g = pool.geometry
    table = torch.tensor(pool.page_table(seq_id), dtype=torch.long, device=pool.device)[None]
    positions = torch.arange(length, device=pool.device).expand(1, g.kv_heads, length)
    ks, vs = [], []
    for layer in range(g.layers):
        k, v = gather_kv(pool, layer, table, positions)  # [1, Hkv, L, D]
        ks.append(k[0].transpose(0, 1))
        vs.append(v[0].transpose(0, 1))
    return torch.stack(ks), torch.stack(vs)


def load_kv(pool: PagePool, seq_id, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Append the given K/V ([layers, n, Hkv, D], rotated keys) to a sequence through the pool's own
    prepare/write/commit, so full pages are sealed (summaries built) exactly as after a prefill."""
    n = keys.shape[1]
    if n == 0:
        return
    if not pool.grow(seq_id, pool.length(seq_id) + n):
        raise ValueError(f"the eval pool has no room for {n} more tokens of sequence {seq_id!r}")
    step = pool.prepare([seq_id], [n])
    for layer in range(pool.geometry.layers):
        pool.write(layer, step, keys[layer], values[layer])
    pool.commit(step)


def prefill(runner: PagedLlama, seq_id, ids: list[int], chunk: int = 512) -> torch.Tensor:
    """Dense chunked prefill of `ids` after what the sequence already holds; returns the last token's logits."""
    logits = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        step = runner.pool.prepare([seq_id], [len(piece)])
        logits, _ = runner.forward(step, torch.tensor(piece, dtype=torch.long), decode=False)
        runner.pool.commit(step)
    if logits is None:
        raise ValueError("prefill got no tokens")
    return logits[0]


def dense_prefix(hf_model, ids: list[int], page_size: int, rank: int, device, chunk: int = 512):
    """Prefill `ids` densely in a scratch pool and return (keys, values [layers, n, Hkv, D], last logits [V])."""
    geometry = geometry_for(hf_model.config, page_size, rank, kinds=("quest",))  # scratch: cheap summaries
    pool = PagePool(geometry, max(1, -(-len(ids) // page_size)), device)
    runner = PagedLlama(hf_model, pool, OvalConfig(page_size=page_size, kv_dtype="float32"), attention="dense")
    pool.allocate("prefix", len(ids))
    logits = prefill(runner, "prefix", ids, chunk)
    keys, values = capture_kv(pool, "prefix", len(ids))
    return keys, values, logits
