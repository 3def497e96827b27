"""What a static decode step decides besides its shapes, bound when the step is built ([R-static-step]).

The engine's step, `oval-edge eval`'s policies and the calibrated window module all run the one static step
(static_step.py); they differ only in the inputs below, fixed for the step's lifetime, so the step's ops stay the same
at every length and a CUDA graph captures them:

    config     the OvalConfig the step selects with (top-k, window range, sink pages, scorer, dense layers)
    attention  'oval' or 'dense' (every layer reads every cached token: the baseline and the short-context step)
    scores     a page scorer replacing the config's one in sparse layers: (layer, grouped q [B, Hkv, G, D],
               page_table [B, W], sealed [B], lengths [B]) -> scores [B, Hkv, W] (eval's oracle and mixed-scorer
               rows, selection reuse); None scores with the config's scorer through the step's kernels
    window     each KV head's window length: (layer, normed hidden x [B, hidden], positions [B]) -> [B, Hkv] in
               tokens, or None for the config's own rule (the calibrated window module, WindowModuleInput below)
    selected   called with every sparse layer's full selection (pages picked included): (layer, q [B, Hq, D],
               Selection) -> None, after it is made (selection reuse records what it picked); a step with it
               builds the detailed selection, a few ops more per layer
    begin      called on the host when a step's inputs are loaded, before it runs: (seq_ids, lengths after the
               step) of its real rows (selection reuse binds its per-sequence state)

A policy with `scores`, `window` or `selected` is host code the step calls between its ops: such a step runs eager
(never captured or compiled) unless the callables are themselves graph-safe (the window module is: WindowModuleInput).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oval_edge.config import OvalConfig

ATTENTION_MODES = ("oval", "dense")
ScoreInput = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
WindowInput = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]
SelectedInput = Callable[[int, torch.Tensor, object], None]
BeginInput = Callable[[list, list], None]


@dataclass(frozen=True)
class StepPolicy:
    config: OvalConfig | None = None  # None: the runner's
    attention: str | None = None  # None: the runner's
    scores: ScoreInput | None = None
    window: WindowInput | None = None
    selected: SelectedInput | None = None
    begin: BeginInput | None = None

    def __post_init__(self) -> None:
        if self.attention is not None and self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention={self.attention!r} is unknown; allowed: {', '.join(ATTENTION_MODES)}")
        if self.window is not None and self.config is not None and self.config.window_min == self.config.window_max:
            raise ValueError("a window input needs window_min < window_max: it chooses each head's window inside "
                             f"that range (got {self.config.window_min}, {self.config.window_max})")

    def graph_safe(self) -> bool:
        """True when the step may be captured or compiled: no host callable between its ops."""
        return self.scores is None and self.selected is None and (
            self.window is None or getattr(self.window, "graph_safe", False))


class WindowModuleInput:
    """The calibrated window module (oval_edge/sparse/window_module.py) as a step input: its windows for every
    layer from the module's first one; graph-safe (the module's MLP is a fixed chain of tensor ops)."""

    graph_safe = True

    def __init__(self, hook) -> None:
        self.hook = hook  # window_module.WindowHook: the module and its window range

    def __call__(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        module = self.hook.module
        if module.training or layer < module.card.first_layer:  # host flags, not tensors: graph-safe
            return None
        return self.hook.lengths(layer, x, positions)
