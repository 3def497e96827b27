"""The runtime pieces `oval-edge eval` drives: a pool that seals each row with its own eta, the engine's static
decode step run for every policy of a pass as row groups of one batch, the oracle page scorer, and K/V copying
between sequences.

One forward per teacher-forced step serves all policies: the weights (the bulk of a CPU decode step) are read
once for the whole batch. Rows are grouped by the static step they decode with (step_key: dense / window / each
scorer per budget / each reuse row); each group's attention is the engine's own ([R-static-step]).
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
from oval_edge.kv.records.summaries import seal_pages
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
from oval_edge.runtime.engine.forward.step_policy import StepPolicy, WindowModuleInput
from oval_edge.runtime.engine.forward.step_rows import StaticDecodeRows, StepStats
from oval_edge.sparse.attention import flat_slots, gather_kv, gather_rows
from oval_edge.sparse.scoring import group_queries
from oval_edge.state_layout import state_layout

from oval_edge.sparse.reuse import ReuseInput, SelectionReuse

from .policies import Policy


def geometry_for(model_config, page_size: int, rank: int, kinds=("oval", "quest"), record: str = "float",
                 kv_dtype: str = "float32", group_pages: int = 0) -> KVGeometry:
    """A pool geometry for the eval's pools (both summaries by default: rows of either scorer share it); record:
    how the oval records are stored (page_record.py); kv_dtype: the K/V storage (int8: summaries stay fp32);
    group_pages: coarse records for two-level rows (grouped.py)."""
    if state_layout(model_config) is not None:  # its rows would each need the prefix's state copied too
        raise ValueError(f"eval does not yet take a hybrid model ({model_config.model_type}: state layers of "
                         "linear attention or short conv); serve and bench run it")
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
    kind: str  # 'dense', 'window', 'scored' or 'module'
    scorer: str  # the rows' page scorer: 'oval', 'oval:G' (two levels), 'quest' or 'oracle' (Policy.scorer)
    reuse: ReuseInput | None = None  # one oval row that reuses selections (oval_edge/sparse/reuse.py)


def step_key(row: int, policy: Policy) -> tuple:
    """Rows with the same key decode in one static step (one StepPolicy): same config, same scorer. A reuse row
    keeps its own selections, so it is a step of its own."""
    if policy.reuse_tau is not None:
        return ("reuse", row)
    kind = policy.group_key()[0]
    return (kind, policy.top_k, policy.window, policy.scorer if kind == "scored" else None)


class EvalRunner:
    """Every policy of a pass as rows of one forward through the engine's static decode step.

    Rows are grouped by step_key; each group is a static step (runtime/engine/forward/static_step.py) built with its
    own StepPolicy: its OvalConfig (window rows: no pages; scored rows: their top-k and scorer; window-range rows:
    the entropy rule or the calibrated module as the step's window input), the oracle's page scores as the step's
    scorer, a reuse row's reused pages likewise. The groups run as row groups of one PagedLlama.forward_rows, so the
    weights are read once per teacher-forced step, and each group's attention is exactly the engine's.

    row_policies[b] is the policy of batch row b; every step must list the rows in that order. `reads` accumulates,
    per row, the K/V slots attended in sparse layers (summed over KV heads), `window_sum` the window lengths (summed
    over KV heads), `sparse_layer_steps` the sparse layers decoded.
    """

    def __init__(self, hf_model, pool: PagePool, base: OvalConfig, row_policies: Sequence[Policy],
                 window_module=None):
        self.runner = PagedLlama(hf_model, pool, base, attention="oval")
        self.pool, self.config = pool, base
        self.row_policies = list(row_policies)
        keys: dict[tuple, list[int]] = defaultdict(list)
        for row, policy in enumerate(self.row_policies):
            keys[step_key(row, policy)].append(row)
        hook = self._window_hook(window_module)
        self.groups: list[RowGroup] = []
        self.decoders = []
        for rows in keys.values():
            first = self.row_policies[rows[0]]
            kind = "module" if first.name == "module" else first.group_key()[0]
            # Two-level scoring only where the row asks for it (its pool holds coarse records for those rows only)
            config = first.config(base).replace(group_pages=first.group_pages)
            group = RowGroup(torch.tensor(rows, dtype=torch.long, device=pool.device), rows, config, kind,
                             first.scorer)
            if first.reuse_tau is not None:
                group.reuse = self._reuse(config.replace(reuse_tau=first.reuse_tau))
            self.groups.append(group)
            self.decoders.append(self.runner.static_decoder(self._policy(group, hook), rows=len(rows)))
        self.reads = torch.zeros(len(self.row_policies), dtype=torch.float64)
        self.window_sum = torch.zeros(len(self.row_policies), dtype=torch.float64)
        self.sparse_layer_steps = torch.zeros(len(self.row_policies), dtype=torch.long)

    def _window_hook(self, window_module):
        ranges = {p.window for p in self.row_policies if p.name == "module"}
        if not ranges:
            return None
        from oval_edge.sparse.window_module import WindowHook

        if window_module is None:
            raise ValueError("the module policy needs a calibrated window module (--window-module FILE)")
        if len(ranges) > 1:
            raise ValueError(f"module rows must share one window range, got {sorted(ranges)}")
        return WindowHook(window_module, *ranges.pop())

    def _policy(self, group: RowGroup, hook) -> StepPolicy:
        """The static step's inputs for one row group."""
        if group.kind == "dense":
            return StepPolicy(config=group.config, attention="dense")
        window = WindowModuleInput(hook) if group.kind == "module" else None
        if group.reuse is not None:
            reuse = group.reuse
            return StepPolicy(config=group.config, scores=reuse.scores, selected=reuse.selected, begin=reuse.begin)
        if group.kind == "window":  # no page is selected (top_k = 0): constant scores skip a scorer never used
            return StepPolicy(config=group.config, scores=_no_scores)
        if group.scorer == "oracle":
            return StepPolicy(config=group.config, scores=self._oracle_scores, window=window)
        return StepPolicy(config=group.config, window=window)  # the engine's own scorer for the config

    def _reuse(self, config: OvalConfig) -> ReuseInput:
        r = self.runner
        state = SelectionReuse.for_model(config, len(r.layers), r.num_heads, r.kv_heads, r.head_dim, self.pool.device)
        return ReuseInput(state, self.pool, config, r.scale)

    def _oracle_scores(self, layer: int, grouped: torch.Tensor, page_table: torch.Tensor, sealed: torch.Tensor,
                       lengths: torch.Tensor) -> torch.Tensor:
        q = grouped.reshape(grouped.shape[0], -1, grouped.shape[-1])  # [n, Hq, D]
        return oracle_page_scores(self.pool, layer, page_table, lengths, q, self.runner.scale)

    def output_metrics(self) -> list[torch.Tensor]:
        return self.runner.output_metrics()

    def forward(self, step: StepIndex, input_ids: torch.Tensor, decode: bool):
        """As PagedLlama.forward: prefill chunks through the runner; a decode step of every row, each group through
        its static step, in one pass over the weights -> (logits [B, vocab] fp32, StepStats of nothing)."""
        if not decode:
            return self.runner.forward(step, input_ids, decode=False)
        if len(step.seq_ids) != len(self.row_policies):
            raise ValueError(f"step has {len(step.seq_ids)} rows, the runner was built for {len(self.row_policies)}")
        tokens = input_ids.tolist()
        parts = []
        for group, decoder in zip(self.groups, self.decoders):
            seq_ids = [step.seq_ids[r] for r in group.row_list]
            parts.append(StaticDecodeRows(decoder.load(seq_ids, [tokens[r] for r in group.row_list]), seq_ids))
        outputs = self.runner.forward_rows(parts)
        logits = torch.empty(len(tokens), outputs[0].shape[-1], dtype=outputs[0].dtype, device=outputs[0].device)
        for group, part, out in zip(self.groups, parts, outputs):
            logits[group.rows] = out
            self._count(group, part.attention)
        return logits, StepStats()

    def _count(self, group: RowGroup, attention) -> None:
        """A group's reads and windows this step, from its static attention (sparse layers only)."""
        if not attention.valids:
            return
        rows = group.rows.cpu()
        reads = torch.stack(attention.valids).sum((0, 2, 3))  # [n]: valid slots over sparse layers and KV heads
        self.reads.index_add_(0, rows, reads.double().cpu())
        self.sparse_layer_steps[rows] += len(attention.valids)
        sparse = attention.plan.sparse_rows[:, None]  # [n, 1]: short rows (dense) have no window
        used = sum((window * sparse).sum(1) for window in attention.windows)  # [n]
        self.window_sum.index_add_(0, rows, used.double().cpu())

    def reuse_counts(self, row: int):
        """The reuse counters of a reuse row (None for the others)."""
        group = next(g for g in self.groups if row in g.row_list)
        return group.reuse.counts if group.reuse is not None else None


def _no_scores(layer: int, grouped: torch.Tensor, page_table: torch.Tensor, sealed: torch.Tensor,
               lengths: torch.Tensor) -> torch.Tensor:
    return torch.zeros(grouped.shape[0], grouped.shape[1], page_table.shape[1], device=grouped.device)


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
