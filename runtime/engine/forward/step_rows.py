"""The row groups one forward step carries, each with its own attention (PagedLlama.forward_rows runs them together).

A step's tokens are concatenated: [decode rows | prefill chunk of request a | chunk of request b ...]. Every layer's
norms, projections and MLP run once over all of them (the 4-bit weights are read once per step, not once per
group); only attention is per group:

    PrefillRows       chunks of one or more prompts: dense, exact causal attention over the chunk and the row's
                      earlier pages (oval_edge/sparse/prefill.prefill_attention)
    DecodeRows        one new token per row through the eager OVAL decode (hooks, the eval's policies, reuse)
    StaticDecodeRows  one new token per row through the static step's attention (static_step.py), so a decode row
                      computes the same whether its step also carries prefill chunks or not

Each group writes its own K/V into the pool, then reads what it may: no group reads another's new tokens (they
belong to other sequences). `seq_ids` and `lengths_list` say what the pool commits after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oval_edge.kv.step_index import StepIndex
from oval_edge.sparse.attention import decode_plan
from oval_edge.sparse.prefill import prefill_attention
from oval_edge.sparse.sliding import ring_slots, sliding_decode, sliding_prefill


@dataclass
class StepStats:
    """What one decode step read, summed over layers (for /metrics and the benchmark's KV bytes per step)."""

    kv_tokens_read: int = 0  # gathered K/V slots x KV heads, all layers, all rows
    attended_tokens: int = 0  # valid slots among them
    sparse_layers: int = 0
    summary_bytes: int = 0  # page records (summaries) scoring read, all layers, all rows
    windows: list[torch.Tensor] = field(default_factory=list)  # adaptive window lengths of sparse rows
    window_mean: float = 0.0


class PrefillRows:
    """Prompt chunks of the step's `seq_ids` (StepIndex from PagePool.prepare); ids [N] concatenated by row."""

    decode = False

    def __init__(self, runner, step: StepIndex, ids: torch.Tensor) -> None:
        self.runner, self.step = runner, step
        self.seq_ids, self.lengths_list = step.seq_ids, step.lengths_list
        self.ids, self.positions = ids.to(runner.pool.device), step.positions
        ends = torch.cumsum(torch.tensor(step.new_tokens), 0) - 1
        self.output_rows = ends.to(runner.pool.device)  # [B]: each row's last token gives its logits

    def attend(self, index: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        if runner.hooks.window is not None:  # the hook's contract: called for every layer of every step
            runner.hooks.window(index, x, self.step)
        if runner.ops[index].sliding:  # reads the window from the ring before the chunk overwrites it
            out = sliding_prefill(runner.pool, index, self.step, q, k, v, runner.scale, runner.softcap)
            runner.pool.write(index, self.step, k, v)
            return out
        runner.pool.write(index, self.step, k, v)
        return prefill_attention(runner.pool, index, self.step, q, k, v, runner.scale, runner.softcap)


class DecodeRows:
    """One new token per row of `step`, through PagedLlama.decode_layer (hooks first, then OVAL or dense)."""

    decode = True

    def __init__(self, runner, step: StepIndex, ids: torch.Tensor, collect: bool = False) -> None:
        self.runner, self.step, self.collect = runner, step, collect
        self.seq_ids, self.lengths_list = step.seq_ids, step.lengths_list
        self.ids, self.positions = ids.to(runner.pool.device), step.positions
        self.output_rows = torch.arange(len(step.seq_ids), device=runner.pool.device)
        self.plan = decode_plan(runner.pool, step, runner.config)
        self.read = StepStats()
        self.attended: list[torch.Tensor] = []  # summed once in stats(): no per-layer reduction on the hot path
        self.ring: tuple[torch.Tensor, torch.Tensor] | None = None  # sliding layers' slots (flat, valid) this step
        self.selections = []

    def attend(self, index: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        runner, read = self.runner, self.read
        window = runner.hooks.window(index, x, self.step) if runner.hooks.window is not None else None
        runner.pool.write(index, self.step, k, v)
        if runner.ops[index].sliding:  # the row's ring, exactly: its window and nothing else
            if self.ring is None:  # the same slots in every sliding layer: built by the first one
                self.ring = ring_slots(self.step.lengths, self.step.ring_base, runner.pool.geometry)
            out = sliding_decode(runner.pool, index, self.ring, q, runner.scale, runner.softcap)
            valid = self.ring[1]
            read.kv_tokens_read += valid.numel()
            self.attended.append(valid)
            return out
        out, selection = runner.decode_layer(index, self.step, q, self.plan, window)
        read.kv_tokens_read += selection.valid.numel()
        self.attended.append(selection.valid)
        if selection.window is not None and self.plan.config.window_min != self.plan.config.window_max:
            read.windows.append(selection.window[selection.sparse_rows])
        scored = selection.window is not None and not self.plan.all_dense
        read.sparse_layers += scored
        if scored:  # the scorers read the listed pages' records of every KV head (scoring.score_pages)
            rows, pages = self.step.page_table.shape
            g, config = runner.pool.geometry, self.plan.config
            read.summary_bytes += rows * g.scoring_bytes(pages, config.top_groups) * g.kv_heads
        if self.collect:
            self.selections.append(selection)
        return out

    def stats(self) -> StepStats:
        """What the step read (one device sync; call after the forward)."""
        read = self.read
        if self.attended:
            read.attended_tokens = int(torch.stack([v.sum() for v in self.attended]).sum())
            read.window_mean = float(torch.cat(read.windows).float().mean()) if read.windows else float(
                self.runner.config.window_min)
        return read


class StaticDecodeRows:
    """The loaded bucket of a static step (static_step.StaticStep.load): B rows, padded ones included, through the
    step's own per-layer attention. `stats_vector()` is the step's device-side statistics, read after it."""

    decode = True

    def __init__(self, step, seq_ids: list) -> None:
        self.step, self.seq_ids, self.lengths_list = step, list(seq_ids), step.lengths_list
        self.ids, self.positions = step.ids, step.positions
        self.output_rows = torch.arange(len(step.lengths_list), device=step.ids.device)  # the real rows
        self.attention = step.layer_attention()

    def attend(self, index: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention(index, x, q, k, v)

    def stats_vector(self) -> torch.Tensor:
        return self.attention.stats()
