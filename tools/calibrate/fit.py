"""Fit the output-aware window module to window targets, and say how well it fits on held-out positions.

Targets arrive in tokens and are normalised into the calibration range [lo, hi]: u* = (clamp(W*, lo, hi) - lo) /
(hi - lo), the reach the runtime maps back linearly. The module's unclamped entropy + offset is fitted to u* by
mean squared error (plus a small penalty on the offset, so that the entropy of the weights carries the window
and the offset stays a correction), full AdamW over mini-batches of positions.

Split: positions are cut into blocks of `block` consecutive tokens and every `every`-th block is held out, so the
held-out positions are not the direct neighbours of training ones (neighbouring tokens have near-equal states).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oval_edge.sparse.window_module import ModuleCard, OutputAwareModule, window_lengths


@dataclass(frozen=True)
class FitSettings:
    steps: int = 600
    batch: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.05
    offset_penalty: float = 0.05
    noise: float = 1.0  # Gaussian input noise in units of each channel's spread (a ridge-like regulariser)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"fit steps={self.steps} and batch={self.batch} must be >= 1")
        if not self.lr > 0 or min(self.weight_decay, self.offset_penalty, self.noise) < 0:
            raise ValueError(f"fit lr={self.lr} must be > 0, weight_decay, offset_penalty and noise >= 0")


def heldout_mask(positions: torch.Tensor, block: int = 64, every: int = 5) -> torch.Tensor:
    """[S] bool: True for positions in every `every`-th block of `block` tokens (the held-out split)."""
    return (torch.div(positions, block, rounding_mode="floor") % every) == every - 1


def normalise(targets: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return (targets.float().clamp(lo, hi) - lo) / (hi - lo)


def fit_module(card: ModuleCard, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
               train: torch.Tensor, settings: FitSettings = FitSettings()) -> OutputAwareModule:
    """hidden [S, Ls, H] (sparse layers' normed states), positions [S], targets [S, Ls, Hkv] in tokens,
    train [S] bool (the calibration split) -> a module with card.calibrated still False (the caller marks it)."""
    if int(train.sum()) < 2:
        raise ValueError(f"the calibration split has {int(train.sum())} positions; give a longer --text")
    torch.manual_seed(settings.seed)
    module = OutputAwareModule(card)
    lo, hi = card.window_range
    x, p, u = hidden[train].float(), positions[train], normalise(targets[train], lo, hi)
    with torch.no_grad():  # standardise each layer's input on the calibration split only
        module.in_mean.copy_(x.mean(0)[:, None, :])
        module.in_scale.copy_(x.std(0)[:, None, :].clamp_min(1e-3))
    optimiser = torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, settings.steps)
    generator = torch.Generator().manual_seed(settings.seed)
    module.train()
    for _ in range(settings.steps):
        pick = torch.randint(0, x.shape[0], (min(settings.batch, x.shape[0]),), generator=generator)
        noisy = x[pick] + settings.noise * module.in_scale.transpose(0, 1) * torch.randn(
            x[pick].shape, generator=generator)
        _, offset, reach = module.raw(noisy, p[pick])
        loss = (reach - u[pick]).pow(2).mean() + settings.offset_penalty * offset.pow(2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
    return module.eval()


@torch.no_grad()
def fit_report(module: OutputAwareModule, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
               train: torch.Tensor) -> dict:
    """Held-out fit in tokens against two baselines fitted on the calibration split: one window for all heads,
    and one window per (layer, KV head), the best any step-blind rule can do with the same mean."""
    lo, hi = module.card.window_range
    want = targets.float().clamp(lo, hi)
    _, _, reach = module(hidden.float(), positions)
    predicted = window_lengths(reach, lo, hi).float()  # [S, Ls, Hkv]
    per_head = want[train].mean(0, keepdim=True).expand_as(want)
    overall = want[train].mean().expand_as(want)
    report = {}
    for split, rows in (("calibration", train), ("heldout", ~train)):
        if not rows.any():
            continue
        w, m, h, o = want[rows], predicted[rows], per_head[rows], overall[rows]
        variance = (w - w.mean()).pow(2).mean().clamp_min(1e-9)
        report[split] = {
            "positions": int(rows.sum()),
            "mae_tokens": float((m - w).abs().mean()),
            "mae_per_head_constant": float((h - w).abs().mean()),
            "mae_global_constant": float((o - w).abs().mean()),
            "r2": float(1 - (m - w).pow(2).mean() / variance),
            "r2_per_head_constant": float(1 - (h - w).pow(2).mean() / variance),
            "mean_window": float(m.mean()),
            "mean_target": float(w.mean()),
        }
    report["mean_reach"] = float(reach[train].mean())
    return report
