"""The output-aware window module ([R-window-module]): a small network that sets each KV head's local window per step.

Per sparse layer l, a 2-layer MLP with GELU reads the layer's normed hidden state x (the input of its attention)
and the token's absolute position, and gives, per KV head, `bins` weights and a window offset:

    z = W2_l · GELU(W1_l · [(x - mean_l) / scale_l, log1p(p)/log1p(P), p/P] + b1_l) + b2_l   -> [Hkv, bins + 1]
    weights = softmax(z[:, :bins]),  e = H(weights) / log(bins)   (normalised entropy, the radius term)
    offset  = tanh(z[:, bins]) / 2   (in [-1/2, 1/2])
    reach   = clamp(e + offset, 0, 1)
    window  = window_min + round(reach · (window_max - window_min))   (>= window_min >= 3 tokens)

What the offset means here. The article's window is centred `offset` tokens back with half-width `radius`. The
runtime's window must keep the newest tokens: the open (unsealed) page has no summary, so the window is the only
way it is read. So the near end of the window stays pinned at the newest token and the offset moves only the far
end (how far back the window reaches): a head reads positions [t - window + 1, t]. The window slots are
max(window_max, page_size), so no offset can leave an open-page position unread.

The module is optional and refused until `oval-edge calibrate` fitted it (`calibrated` in the file's card); in
training mode (`module.train()`) it is disabled and the runtime falls back to its config's window rule.
Torch only (no transformers); safetensors is imported when a file is read or written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

FORMAT = "oval-edge-window-module/1"
POSITION_FEATURES = 2


def _calibrate_hint(path: str) -> str:
    return (f"fit it first: `oval-edge calibrate --model MODEL --text FILE --out {path}` "
            "(the module is noise until it is calibrated on the model's own dense attention)")


@dataclass
class ModuleCard:
    """What a module file was fitted to and how well; stored as JSON in the safetensors metadata."""

    model: str
    num_layers: int
    hidden_size: int
    kv_heads: int
    first_layer: int  # layers below it are dense (config.dense_layers at calibration): no weights for them
    width: int = 32
    bins: int = 8
    max_position: int = 8192
    calibrated: bool = False
    page_size: int = 32
    sink_pages: int = 1
    target_share: float = 0.9  # the window target: smallest recent window holding this share of non-sink mass
    window_range: tuple[int, int] = (16, 256)  # the [window_min, window_max] the targets were normalised with
    mean_reach: float = 0.5  # mean predicted reach on the calibration split (sets equal-average window ranges)
    eta: float | None = None  # the oval scorer's eta and rank frozen on the same split
    rank: int | None = None
    text: str = ""
    fit: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: str) -> "ModuleCard":
        try:
            values = json.loads(text)
            values["window_range"] = tuple(values["window_range"])
            return cls(**values)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"window module {path}: its card is unreadable ({exc}); {_calibrate_hint(path)}") from exc


class OutputAwareModule(nn.Module):
    """Weights of every sparse layer stacked: w1 [Ls, F, M], w2 [Ls, M, Hkv*(bins+1)] with Ls = layers - first."""

    def __init__(self, card: ModuleCard) -> None:
        super().__init__()
        c = card
        for name in ("num_layers", "hidden_size", "kv_heads", "width", "bins", "max_position"):
            value = getattr(c, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "bins" else 1):
                raise ValueError(f"window module: {name}={value!r} must be a positive integer (bins >= 2)")
        if not 0 <= c.first_layer < c.num_layers:
            raise ValueError(f"window module: first_layer={c.first_layer} must be in [0, {c.num_layers - 1}]")
        self.card = c
        layers = c.num_layers - c.first_layer
        features, outputs = c.hidden_size + POSITION_FEATURES, c.kv_heads * (c.bins + 1)
        self.w1 = nn.Parameter(torch.randn(layers, features, c.width) / math.sqrt(features))
        self.b1 = nn.Parameter(torch.zeros(layers, 1, c.width))
        self.w2 = nn.Parameter(torch.randn(layers, c.width, outputs) / math.sqrt(c.width))
        self.b2 = nn.Parameter(torch.zeros(layers, 1, outputs))
        # Standardisation of the hidden state per layer (RMS-normed states still have a few huge channels).
        self.register_buffer("in_mean", torch.zeros(layers, 1, c.hidden_size))
        self.register_buffer("in_scale", torch.ones(layers, 1, c.hidden_size))

    @property
    def calibrated(self) -> bool:
        return bool(self.card.calibrated)

    @property
    def sparse_layers(self) -> int:
        return self.w1.shape[0]

    def _features(self, hidden: torch.Tensor, positions: torch.Tensor, mean, scale) -> torch.Tensor:
        """hidden [Ls, B, H], positions [B] -> [Ls, B, H + 2]."""
        p = positions.to(torch.float32)
        top = float(self.card.max_position)
        pos = torch.stack([torch.log1p(p) / math.log1p(top), p / top], dim=-1)  # [B, 2]
        pos = pos.unsqueeze(0).expand(hidden.shape[0], -1, -1)
        return torch.cat([(hidden.to(torch.float32) - mean) / scale, pos], dim=-1)

    def _heads(self, z: torch.Tensor):
        """z [..., Hkv*(bins+1)] -> weights [..., Hkv, bins], offset [..., Hkv], entropy + offset [..., Hkv]
        (unclamped: the fit's loss needs its gradient where the clamp would cut it)."""
        z = z.reshape(*z.shape[:-1], self.card.kv_heads, self.card.bins + 1)
        logits = z[..., : self.card.bins]
        weights = torch.softmax(logits, dim=-1)
        entropy = -(weights * torch.log_softmax(logits, dim=-1)).sum(-1) / math.log(self.card.bins)
        offset = 0.5 * torch.tanh(z[..., self.card.bins])
        return weights, offset, entropy + offset

    def raw(self, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden [B, Ls, H] (each sparse layer's normed hidden state), positions [B] ->
        (weights [B, Ls, Hkv, bins], offset [B, Ls, Hkv], entropy + offset unclamped [B, Ls, Hkv])."""
        x = self._features(hidden.transpose(0, 1), positions, self.in_mean, self.in_scale)  # [Ls, B, F]
        z = torch.matmul(F.gelu(torch.matmul(x, self.w1) + self.b1), self.w2) + self.b2  # [Ls, B, out]
        return self._heads(z.transpose(0, 1))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden [B, Ls, H], positions [B] (int) -> weights [B, Ls, Hkv, bins], offset [B, Ls, Hkv],
        reach [B, Ls, Hkv] in [0, 1] (the graph exported to ONNX)."""
        weights, offset, unclamped = self.raw(hidden, positions)
        return weights, offset, torch.clamp(unclamped, 0.0, 1.0)

    def layer_reach(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Reach [B, Hkv] of one model layer (>= first_layer) from its normed hidden state x [B, H]."""
        i = layer - self.card.first_layer
        feats = self._features(x[None], positions, self.in_mean[i : i + 1], self.in_scale[i : i + 1])[0]
        z = F.gelu(feats @ self.w1[i] + self.b1[i]) @ self.w2[i] + self.b2[i]  # [B, out]
        return self._heads(z)[2].clamp(0.0, 1.0)


def window_lengths(reach: torch.Tensor, window_min: int, window_max: int) -> torch.Tensor:
    """Reach in [0, 1] -> window length in tokens, linear in [window_min, window_max] and never below 3."""
    lengths = window_min + torch.round(reach.clamp(0.0, 1.0) * (window_max - window_min))
    return lengths.long().clamp(max(3, window_min), max(3, window_max))


class WindowHook:
    """PagedLlama.hooks.window: (layer, normed hidden x [B, H], step) -> window lengths [B, Hkv] or None.

    None (the config's own window rule) for dense layers, for every layer while the module is in training mode,
    and for steps that add more than one token per row (prefill: the window is a decode-time notion)."""

    def __init__(self, module: OutputAwareModule, window_min: int, window_max: int) -> None:
        if not module.calibrated:
            raise ValueError("the window module is not calibrated; " + _calibrate_hint("module.safetensors"))
        if window_max <= window_min:
            raise ValueError(f"the window module needs window_min < window_max (got {window_min}, {window_max}): "
                             "it chooses each head's window inside that range")
        self.module, self.window_min, self.window_max = module, window_min, window_max

    @torch.no_grad()
    def __call__(self, layer: int, x: torch.Tensor, step) -> torch.Tensor | None:
        if self.module.training or layer < self.module.card.first_layer or x.shape[0] != step.lengths.shape[0]:
            return None
        return self.lengths(layer, x, step.positions)

    def lengths(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Window lengths [B, Hkv] of a layer >= the module's first from x [B, hidden] at positions [B]: the decode
        step's window input (runtime/engine/forward/step_policy.py); tensor ops only, no host read."""
        with torch.no_grad():
            return window_lengths(self.module.layer_reach(layer, x, positions), self.window_min, self.window_max)


# ---- files -------------------------------------------------------------------------------------------------

def save_module(module: OutputAwareModule, path: str) -> str:
    from safetensors.torch import save_file

    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, path, metadata={"format": FORMAT, "card": module.card.to_json()})
    return path


def read_card(path: str) -> ModuleCard:
    """The card of a module file (header only, no weights); ValueError as load_module gives."""
    from safetensors import safe_open

    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"window module {path} does not exist; {_calibrate_hint(path)}")
    try:
        with safe_open(path, framework="pt") as handle:
            meta = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise ValueError(f"window module {path} is not a safetensors file ({exc})") from exc
    if meta.get("format") != FORMAT or "card" not in meta:
        raise ValueError(f"window module {path} is not an oval-edge window module (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}); {_calibrate_hint(path)}")
    card = ModuleCard.from_json(meta["card"], path)
    if not card.calibrated:
        raise ValueError(f"window module {path} holds untrained weights (never calibrated); {_calibrate_hint(path)}")
    return card


def calibrated_window_range(path: str) -> tuple[int, int]:
    return tuple(read_card(path).window_range)


def load_module(path: str, device: str | torch.device = "cpu", model_config=None,
                model_name: str | None = None) -> OutputAwareModule:
    """Read a calibrated module; ValueError (naming the file) if it is missing, not a module, uncalibrated, or
    fitted to another model geometry (model_config: a transformers config) or model (model_name)."""
    from safetensors.torch import load_file

    path = os.path.abspath(os.path.expanduser(path))
    card = read_card(path)
    tensors = load_file(path)
    if model_config is not None:
        want = {"num_layers": model_config.num_hidden_layers, "hidden_size": model_config.hidden_size,
                "kv_heads": model_config.num_key_value_heads}
        wrong = {k: (getattr(card, k), v) for k, v in want.items() if getattr(card, k) != v}
        if wrong:
            raise ValueError(f"window module {path} was calibrated for another model geometry "
                             f"({', '.join(f'{k} {a} != {b}' for k, (a, b) in wrong.items())}); "
                             + _calibrate_hint(path))
    if model_name is not None and card.model != model_name:
        raise ValueError(f"window module {path} was calibrated for model {card.model!r}, not {model_name!r}; "
                         + _calibrate_hint(path))
    module = OutputAwareModule(card)
    try:
        module.load_state_dict(tensors)
    except RuntimeError as exc:
        raise ValueError(f"window module {path}: its tensors do not match its card ({exc})") from exc
    if not all(torch.isfinite(t).all() for t in tensors.values()):
        raise ValueError(f"window module {path} holds non-finite weights; {_calibrate_hint(path)}")
    return module.to(device).eval()


def window_hook(config, model_config=None, model_name: str | None = None, device="cpu") -> WindowHook:
    """The runtime's window hook for `config.window_module` (an OvalConfig), mapped into its window range."""
    module = load_module(config.window_module, device, model_config, model_name)
    return WindowHook(module, config.window_min, config.window_max)
