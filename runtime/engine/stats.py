"""Counters and recent rates the engine keeps for /metrics, logs and the benchmark."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from oval_edge.geometry import KVGeometry

from .forward.step_rows import StepStats


@dataclass
class EngineStats:
    pages_total: int = 0
    pages_used: int = 0
    running: int = 0
    waiting: int = 0
    refused: int = 0
    cancelled: int = 0
    errors: int = 0
    preemptions: int = 0  # requests sent back to the queue to free pages (scheduler.py)
    mixed_steps: int = 0  # steps whose forward carried decode rows and prompt chunks together
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    # Last decode step: bytes of K/V gathered (all layers, all rows) and tokens attended per layer and row.
    kv_bytes_last_step: int = 0
    summary_bytes_last_step: int = 0  # page records (summaries) the last decode step's scoring read, all layers
    state_bytes_last_step: int = 0  # a hybrid's layer states the last decode step read, all rows
    attended_per_row_layer: float = 0.0
    window_mean: float = 0.0
    sparse_layer_steps: int = 0
    _recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (tokens, seconds) of recent steps

    def record_decode(self, rows: int, seconds: float, step: StepStats, geometry: KVGeometry) -> None:
        self.decode_steps += 1
        self._recent.append((rows, seconds))
        # kv_tokens_read counts gathered slots x KV heads; each slot moves a K and a V row (int8: codes + scale).
        self.kv_bytes_last_step = step.kv_bytes if step.kv_bytes is not None else \
            step.kv_tokens_read * 2 * geometry.kv_row_bytes
        self.summary_bytes_last_step = step.summary_bytes
        self.state_bytes_last_step = step.state_bytes
        per = max(1, rows * geometry.layers * geometry.kv_heads)
        self.attended_per_row_layer = step.attended_tokens / per
        self.sparse_layer_steps += step.sparse_layers
        if step.sparse_layers:
            self.window_mean = step.window_mean

    @property
    def decode_tokens_per_second(self) -> float:
        tokens = sum(t for t, _ in self._recent)
        seconds = sum(s for _, s in self._recent)
        return tokens / seconds if seconds > 0 else 0.0

    @property
    def pages_free(self) -> int:
        return self.pages_total - self.pages_used
