"""The row groups one forward step carries, each with its own attention (PagedLlama.forward_rows runs them together).

A step's tokens are concatenated: [decode rows | prefill chunk of request a | chunk of request b ...]. Every layer's
norms, projections and MLP run once over all of them (the 4-bit weights are read once per step, not once per
group); only attention is per group:

    PrefillRows       chunks of one or more prompts: dense, exact causal attention over the chunk and the row's
                      earlier pages (oval_edge/sparse/prefill.prefill_attention)
    StaticDecodeRows  one new token per row through the static step's attention (static_step.py), so a decode row
                      computes the same whether its step also carries prefill chunks or not (and eval's row
                      groups, each a step with its own policy, share one pass over the weights)

Each group writes its own K/V into the pool, then reads what it may: no group reads another's new tokens (they
belong to other sequences). `seq_ids` and `lengths_list` say what the pool commits after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oval_edge.kv.step_index import StepIndex
from oval_edge.sparse.prefill import prefill_attention
from oval_edge.sparse.sliding import sliding_prefill


@dataclass
class StepStats:
    """What one decode step read, summed over layers (for /metrics and the benchmark's KV bytes per step)."""

    kv_tokens_read: int = 0  # gathered K/V slots x KV heads, all layers, all rows
    kv_bytes: int | None = None  # their K and V bytes (None: kv_tokens_read x 2 rows of the pages' width)
    attended_tokens: int = 0  # valid slots among them
    sparse_layers: int = 0
    summary_bytes: int = 0  # page records (summaries) scoring read, all layers, all rows
    state_bytes: int = 0  # a hybrid's layer states read (and written back), all state layers, all rows
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
        # Gemma 4: a sliding layer whose ring later layers read keeps each row's window before the chunk here
        self.windows: dict[int, dict] = {layer: {} for layer in runner.kv_sources}

    def attend(self, index: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v: this layer's new K/V, stored here; a layer reading another's (Gemma 4) gets that layer's and stores
        nothing."""
        runner = self.runner
        if runner.hooks.observe is not None:  # the hook's contract: called for every layer of every chunk
            runner.hooks.observe(index, x, self.step)
        source = runner.ops[index].kv_source
        owner = index if source < 0 else source
        if runner.ops[index].sliding:  # reads the window from the ring before the chunk overwrites it
            out = sliding_prefill(runner.pool, index, self.step, q, k, v, runner.scale, runner.softcap,
                                  self.windows.get(owner))
            if source < 0:
                runner.pool.write(index, self.step, k, v)
            return out
        if source < 0:
            runner.pool.write(index, self.step, k, v)
        return prefill_attention(runner.pool, index, self.step, q, k, v, runner.scale, runner.softcap)

    def mix(self, index: int, state, x: torch.Tensor) -> torch.Tensor:
        """A hybrid's state layer over each row's chunk x [n_b, hidden] in turn, from and into the row's state slot
        (a chunk continues where the row's previous chunk left its state)."""
        states = self.runner.pool.states
        conv, recurrent = states.layer(index)
        outs, offset = [], 0
        for sid, n in zip(self.step.seq_ids, self.step.new_tokens):
            slot = states.slot(sid)
            outs.append(state.prefill(x[offset : offset + n], conv[slot],
                                      None if recurrent is None else recurrent[slot]))
            offset += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]


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

    def mix(self, index: int, state, x: torch.Tensor) -> torch.Tensor:
        return self.attention.mix(index, state, x)

    def stats_vector(self) -> torch.Tensor:
        return self.attention.stats()
