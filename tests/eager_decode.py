"""The eager decode forward, kept as the tests' reference for the static step ([R-static-step]).

The runtime decodes with one implementation, the static step (runtime/engine/forward/static_step.py). This is the
flexible forward it replaced, whose shapes follow the context and whose Python branches read device values: it runs
`oval_edge.sparse.attention.decode_attention` per layer (the per-layer reference next to tests/oval_reference.py), so
the static step's logits, selections and statistics can be compared with an independent path. `scores`, `window`
and `layer` are the per-layer overrides the eager forward used to take as hooks.
"""

from __future__ import annotations

import torch

from oval_edge.runtime.engine.forward.step_rows import StepStats
from oval_edge.sparse.attention import decode_attention, decode_plan
from oval_edge.sparse.sliding import ring_slots, sliding_decode


class EagerDecodeRows:
    """One new token per row of `step` through decode_attention, layer by layer (a row group of
    PagedLlama.forward_rows)."""

    decode = True

    def __init__(self, runner, step, ids: torch.Tensor, collect: bool = False, config=None, attention=None,
                 scores=None, window=None, layer=None) -> None:
        self.runner, self.step, self.collect = runner, step, collect
        self.config = config if config is not None else runner.config
        self.attention = attention if attention is not None else runner.attention
        self.score_override, self.window_override, self.layer_override = scores, window, layer
        self.seq_ids, self.lengths_list = step.seq_ids, step.lengths_list
        self.ids, self.positions = ids.to(runner.pool.device), step.positions
        self.output_rows = torch.arange(len(step.seq_ids), device=runner.pool.device)
        self.plan = decode_plan(runner.pool, step, self.config)
        self.read = StepStats()
        self.attended: list[torch.Tensor] = []
        self.ring = None
        self.selections = []

    def attend(self, index: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        runner, read = self.runner, self.read
        window = self.window_override(index, x, self.step) if self.window_override is not None else None
        runner.pool.write(index, self.step, k, v)
        if runner.ops[index].sliding:
            if self.ring is None:
                self.ring = ring_slots(self.step.lengths, self.step.ring_base, runner.pool.geometry)
            out = sliding_decode(runner.pool, index, self.ring, q, runner.scale, runner.softcap)
            read.kv_tokens_read += self.ring[1].numel()
            self.attended.append(self.ring[1])
            return out
        dense = self.attention == "dense" or index < self.config.dense_layers
        scores = self.score_override(index, q, self.step) if self.score_override is not None and not dense else None
        decided = None
        if scores is None and self.layer_override is not None:
            decided = self.layer_override(index, self.step, q, self.plan, window, dense)
        if decided is not None:
            out, selection = decided
        else:
            out, selection = decode_attention(runner.pool, index, self.step, q, self.config, runner.scale,
                                              dense=dense, scores=scores, softcap=runner.softcap, plan=self.plan,
                                              window=window)
        read.kv_tokens_read += selection.valid.numel()
        self.attended.append(selection.valid)
        if selection.window is not None and self.config.window_min != self.config.window_max:
            read.windows.append(selection.window[selection.sparse_rows])
        scored = selection.window is not None and not self.plan.all_dense
        read.sparse_layers += scored
        if scored:
            rows, pages = self.step.page_table.shape
            g = runner.pool.geometry
            read.summary_bytes += rows * g.scoring_bytes(pages, self.config.top_groups) * g.kv_heads
        if self.collect:
            self.selections.append(selection)
        return out

    def stats(self) -> StepStats:
        read = self.read
        if self.attended:
            read.attended_tokens = int(torch.stack([v.sum() for v in self.attended]).sum())
            read.window_mean = float(torch.cat(read.windows).float().mean()) if read.windows else float(
                self.config.window_min)
        return read


@torch.inference_mode()
def eager_decode(runner, step, ids: torch.Tensor, **overrides):
    """The eager decode of one token per row: -> (logits [B, vocab] fp32, StepStats, the rows' group). The caller
    commits the step to the pool afterwards, as with PagedLlama.forward."""
    rows = EagerDecodeRows(runner, step, ids, **overrides)
    (logits,) = runner.forward_rows([rows])
    return logits, rows.stats(), rows
