"""The decode step with static shapes ([R-static-step]): per batch bucket, the same ops and shapes at every length.

Why: an eager step whose shapes follow the context (the page table widens every page_size tokens) and whose Python
branches read device values can be neither captured into a CUDA graph nor compiled once, and on a Jetson's ARM
cores each of its ~2,200 dispatched ops costs 10-20 us of launch overhead. Here a step of a bucket of B rows is:

    inputs   one packed int64 buffer, filled on the host and copied to the device once per step:
             ids [B] | positions [B] | lengths [B] | sealed [B] | real [B] | write_base [B] | page_table [B, W]
             W = the pages of the longest sequence the engine admits; rows past the real batch repeat row 0 (the same
             token at the same position writes the same K/V into the same slots, so padding changes nothing)
    body     embedding, RoPE, per layer: norm, q/k/v, write_kv, the selection (DecodePlan(static=True): fixed top-k,
             fixed window buffer, short rows merged with torch.where), page_scores, attend_slots, o/MLP; the head
    outputs  logits [B, vocab] fp32 and a statistics vector reduced on the device, read after the step

No host sync and no host-device copy happens inside `StaticStep.forward` (tests/test_static_step.py checks both
under a TorchDispatchMode, and that torch.compile(fullgraph=True) traces it with no recompiles). The kernels skip
the padded part of the work by each row's length (counts, limits), so the padding costs shapes, not reads. Sealing
the pages a step filled runs after it (PagePool.advance), batched over the rows.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from oval_edge.geometry import batch_buckets
from oval_edge.step_memory import narrowest_width, width_buckets
from oval_edge.kernels.cpu import decode_kernels
from oval_edge.kernels.gpu import gpu_kernels
from oval_edge.kv.records.page_record import Rotations
from oval_edge.sparse.grouped import uses_groups
from oval_edge.sparse.selection import slots_per_step
from oval_edge.sparse.step_ops_table import step_ops_table

from .step_policy import StepPolicy
from .step_rows import StepStats

# `runner` below is a paged_llama.PagedLlama (not imported here: PagedLlama.static_decoder builds these steps).
# [B] each, then page_table [B, W]; ring_base: each row's first ring page (sliding layers, oval_edge/kv/ring.py);
# state_slot: each row's slot of a hybrid's layer states (oval_edge/kv/state.py)
ROW_FIELDS = ("ids", "positions", "lengths", "sealed", "real", "write_base", "ring_base", "state_slot")


class StaticStep:
    """One bucket's step: its preallocated inputs and the static forward over them."""

    def __init__(self, runner, batch: int, width: int, compile_backend: str | None = None,
                 rotations: Rotations | None = None, policy: StepPolicy | None = None) -> None:
        pool = runner.pool
        self.runner, self.pool, self.batch, self.width = runner, pool, batch, width
        self.policy = policy = policy if policy is not None else StepPolicy()
        self.config = config = policy.config if policy.config is not None else runner.config
        self.attention = policy.attention if policy.attention is not None else runner.attention
        dev = pool.device
        size = batch * (len(ROW_FIELDS) + width)
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.packed = self.host if dev.type == "cpu" else torch.zeros(size, dtype=torch.long, device=dev)
        fields = self.packed[: batch * len(ROW_FIELDS)].view(len(ROW_FIELDS), batch)
        (self.ids, self.positions, self.lengths, self.sealed, self.real, self.write_base, self.ring_base,
         self.state_slot) = fields.unbind(0)
        self.page_table = self.packed[batch * len(ROW_FIELDS):].view(batch, width)
        g = pool.geometry
        self.head_offsets = torch.arange(g.kv_heads, device=dev) * g.page_size  # [Hkv]: head h's rows in a page
        self.sliding = [ops.sliding for ops in runner.ops]  # ring layers: neither dense over pages nor scored
        self.states = [ops.state is not None for ops in runner.ops]  # a hybrid's state layers: no K/V at all
        self.dense = [not (self.sliding[i] or self.states[i]) and (self.attention == "dense" or i < config.dense_layers)
                      for i in range(len(runner.layers))]
        self.dense_layers = sum(self.dense)
        self.sliding_layers = sum(self.sliding)
        self.slots = slots_per_step(config)
        # compile_backend: None runs the step eager; "inductor" (decode_step="compiled") or another torch.compile backend
        # (the tests use "aot_eager": the same trace, the eager kernels' exact arithmetic).
        if compile_backend is not None and pool.int8 is not None:  # the operators of step_ops take no scales
            raise ValueError("decode_step='compiled' does not take kv_dtype='int8'; use decode_step='static' (the "
                             "default) or 'eager'")
        if compile_backend is not None and not policy.graph_safe():
            raise ValueError("a step policy with host callables (eval's scorers, reuse) cannot be compiled; build "
                             "the step without compile_backend")
        self.run = self.forward if compile_backend is None else torch.compile(
            self.forward, fullgraph=True, dynamic=False, backend=compile_backend)
        self.lengths_list: list[int] = []
        # The ops of this step (write, scores, select, attend), each body chosen once here from what the kernels
        # take: C on a CPU, Triton on CUDA, torch otherwise (oval_edge/sparse/step_ops_table.py); what they read
        # besides the pool (the int4 record's rotation, byte tables) is built now, before any capture, never in a step
        rotations = rotations if rotations is not None else Rotations()
        self.triton = gpu_kernels(dev) if dev.type != "cpu" else None
        scored = [not (self.dense[i] or self.sliding[i] or self.states[i]) for i in range(len(runner.layers))]
        self.ops = step_ops_table(pool, config, width, runner.num_heads, runner.scale, scored, runner.softcap,
                                  dtype=runner.decoder.norm.weight.dtype, traced=compile_backend is not None,
                                  rotations=rotations)
        # What the attention reads per slot: the C and Triton bodies read the valid slots in place; the torch ops
        # gather all
        self.reads_valid_only = self.ops.attends_in_place()
        # A page store (oval_edge/kv/store/): each layer recalls the stored pages its selection names before it
        # attends (host decisions per layer), so such a step runs eager and is never captured
        self.recalls = pool.store is not None

    def load(self, seq_ids: list, tokens: list[int]) -> None:
        """Write this step's inputs for the rows (one new token each) into the buffer: one copy to the device."""
        pool, P, hkv, width = self.pool, self.pool.page_size, self.pool.geometry.kv_heads, self.width
        n = len(seq_ids)
        if not 1 <= n <= self.batch:
            raise ValueError(f"a bucket of {self.batch} rows cannot take {n}")
        rows = [[] for _ in ROW_FIELDS]
        tables: list[int] = []
        self.lengths_list = []
        for row in range(self.batch):
            sid, token = (seq_ids[row], tokens[row]) if row < n else (seq_ids[0], tokens[0])
            position = pool.length(sid)
            table = pool.page_table(sid)[: pool.pages_needed(position + 1)]
            if len(table) > width or len(table) * P <= position:
                raise ValueError(f"sequence {sid!r} at position {position} does not fit this step's {width}-page "
                                 "tables or its own pages (it was admitted beyond the engine's token limit?)")
            ring = pool.rings.base(sid) if pool.rings is not None else 0
            slot = pool.states.slot(sid) if pool.states is not None else 0
            for values, value in zip(rows, (token, position, position + 1, pool.sealed_pages(sid), int(row < n),
                                            table[position // P] * hkv * P + position % P, ring, slot)):
                values.append(value)
            tables.extend(table)
            tables.extend([0] * (width - len(table)))
            if row < n:
                self.lengths_list.append(position + 1)
                if pool.int8 is not None:  # the staging slot of the page this row writes (oval_edge/kv/int8.py)
                    pool.int8.stage(table, position, 1, P)
        if self.policy.begin is not None:
            self.policy.begin(list(seq_ids), list(self.lengths_list))
        self.host.copy_(torch.tensor([v for values in rows for v in values] + tables, dtype=torch.long))
        if self.packed is not self.host:
            self.packed.copy_(self.host, non_blocking=True)

    def load_idle(self) -> None:
        """Inputs for warm-up and capture (cuda_graph.py), while no sequence holds a page: every row is token 0 at
        position 0 of physical page 0 (lengths 1, nothing sealed, no real row). Writes only page 0's first rows."""
        self.host.zero_()
        self.lengths_list = []
        fields = self.host[: self.batch * len(ROW_FIELDS)].view(len(ROW_FIELDS), self.batch)
        fields[ROW_FIELDS.index("lengths")] = 1
        if self.packed is not self.host:
            self.packed.copy_(self.host, non_blocking=True)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step: logits [B, vocab] fp32 and stats [3] (attended slots, window sum, window count; real rows)."""
        runner = self.runner
        hidden = runner.embed(self.ids)  # [B, hidden]
        tables = runner.rotary_tables(hidden, self.positions)  # [(cos, sin) [B, 1, D]]
        attention = self.layer_attention()
        hidden = runner.run_layers(hidden, tables, attention, per_layer=runner.per_layer_inputs(self.ids, hidden))
        logits = runner.logits(hidden)
        return logits, attention.stats()

    def layer_attention(self) -> "StaticAttention":
        """The per-layer attention of this step over its loaded inputs (also a row group of a mixed step)."""
        from .static_attention import StaticAttention

        return StaticAttention(self)


class StaticDecoder:
    """The engine's decode step: picks the step for a batch, runs it, reads the statistics after it.

    A step has static shapes per batch bucket and, where it reads every listed page (the torch ops: every page's
    record scored, dense layers over the whole padded table), per page-table width too: the narrowest width bucket
    that holds the batch's longest row, chosen on the host before the step runs (or replays), so a batch of short
    rows never pays for max_model_len. Where kernels read each row's own pages (native CPU, Triton) one width."""

    def __init__(self, runner, max_batch: int, max_tokens: int, compile_backend: str | None = None,
                 policy: StepPolicy | None = None, exact_batches: bool = False) -> None:
        """policy: what the steps decide besides their shapes (step_policy.py; default the runner's config and
        attention). exact_batches: a step per row count instead of power-of-two buckets (a caller whose row count
        never changes, as eval's, pays no padded rows)."""
        self.runner, self.policy = runner, policy if policy is not None else StepPolicy()
        pool = runner.pool
        config = self.policy.config if self.policy.config is not None else runner.config
        self.config = config
        self.exact = exact_batches
        self.buckets = (max_batch,) if exact_batches else batch_buckets(max_batch)
        self.width = pool.pages_needed(max_tokens)
        # compiled steps keep one width: each (bucket, width) would be one more compilation of the same forward
        one = decode_kernels(pool.device) is not None or compile_backend is not None
        self.widths = (self.width,) if one else width_buckets(self.width, narrowest_width(config))
        self.compile_backend = compile_backend
        self.rotations = Rotations()  # the int4 record's rotation, built once for every bucket's step
        self._steps: dict[tuple[int, int], StaticStep] = {}  # (bucket, width) -> step, built on first use or capture
        self.graphs = None  # cuda_graph.CaptureReport once `capture` ran

    def capture(self, backend) -> None:
        """Capture every bucket's step into a graph now (cuda_graph.py); later steps replay. Call while the pool
        is empty (startup): the capture's inputs write page 0."""
        from .cuda_graph import capture_steps

        if self.compile_backend is not None:
            raise ValueError("decode_step='compiled' and CUDA graphs do not combine; use decode_step='static'")
        if not self.policy.graph_safe() or self.runner.pool.store is not None:
            raise ValueError("this step calls host code between its ops (a policy's scorer, or a page store's "
                             "recalls) and cannot be captured; run it eager (cuda_graphs off)")
        self.graphs = capture_steps(self, backend)

    def step_for(self, rows: int, width: int | None = None) -> StaticStep:
        """The step of the batch bucket for `rows` rows over page tables `width` wide (one of self.widths; None: the
        widest)."""
        bucket = rows if self.exact and rows >= 1 else next((size for size in self.buckets if size >= rows), None)
        if bucket is None:
            raise ValueError(f"{rows} rows exceed max_batch={self.buckets[-1]}")
        width = self.width if width is None else width
        if width not in self.widths:
            raise ValueError(f"no static step is built for {width}-page tables; widths: {self.widths}")
        if (bucket, width) not in self._steps:
            self._steps[bucket, width] = StaticStep(self.runner, bucket, width, self.compile_backend, self.rotations,
                                                    self.policy)
        return self._steps[bucket, width]

    def width_for(self, seq_ids: list) -> int:
        """The narrowest width bucket holding every row's pages after this step's token (host bookkeeping only)."""
        pool = self.runner.pool
        longest = max(pool.pages_needed(pool.length(sid) + 1) for sid in seq_ids)
        return next((width for width in self.widths if width >= longest), self.width)  # too long: load() says so

    def load(self, seq_ids: list, tokens: list[int]) -> StaticStep:
        """The step for these rows (batch bucket, width bucket), its inputs loaded (one host-to-device copy)."""
        step = self.step_for(len(seq_ids), self.width_for(seq_ids))
        step.load(seq_ids, tokens)
        return step

    def decode(self, seq_ids: list, tokens: list[int], trace=None) -> tuple[torch.Tensor, StepStats, list[int]]:
        """One token per row -> (logits [rows, vocab] fp32, what the step read, each row's length after it).

        trace: a dispatch mode (runtime/engine/forward/op_trace.py) active around the step itself, not its input
        loading."""
        step = self.load(seq_ids, tokens)
        with torch.inference_mode(), trace if trace is not None else nullcontext():
            logits, stats = step.run()
        return logits[: len(seq_ids)], self.read_stats(step, stats), list(step.lengths_list)

    def read_stats(self, step: StaticStep, stats: torch.Tensor) -> StepStats:
        """The step's statistics vector [3] -> StepStats: the step's one read back, after it."""
        attended, window_sum, window_count, attended_in_rings = stats.tolist()
        rows = len(step.lengths_list)
        sparse_layers = len(step.dense) - step.dense_layers - step.sliding_layers - sum(step.states)
        shorts = all(length <= step.slots for length in step.lengths_list)
        g = self.runner.pool.geometry
        in_rings = rows * self.runner.kv_heads * step.sliding_layers * g.ring_pages * g.page_size
        gathered = rows * self.runner.kv_heads * (step.dense_layers * step.width * g.page_size + sparse_layers
                                                  * step.slots) + in_rings
        read, read_in_rings = (attended, attended_in_rings) if step.reads_valid_only else (gathered, in_rings)
        # each slot moves a K and a V row: the pages' (int8: codes + scale), the rings' (Gemma 4: narrower heads)
        kv_bytes = 2 * ((read - read_in_rings) * g.kv_row_bytes + read_in_rings * g.ring_dim * g.dtype_bytes)
        # Scoring reads the records of each row's sealed pages (the kernels stop at sealed[b]), in every sparse layer;
        # in two levels, every group's coarse record and the fine records of a fixed set of pages per row.
        config = step.config
        if uses_groups(step.width, config.group_pages, config.top_groups):
            per_head = rows * g.scoring_bytes(self.width, config.top_groups)
        else:
            per_head = sum((length - 1) // g.page_size for length in step.lengths_list) * g.summary_bytes_per_head()
        return StepStats(kv_tokens_read=read, kv_bytes=kv_bytes, attended_tokens=attended,
                         sparse_layers=0 if shorts else sparse_layers,
                         summary_bytes=per_head * sparse_layers * self.runner.kv_heads,
                         state_bytes=rows * g.state_bytes_per_sequence,
                         window_mean=window_sum / window_count if window_count else float(config.window_min))
