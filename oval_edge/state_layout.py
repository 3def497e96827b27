"""The fixed-size per-sequence state of a hybrid model's non-attention layers ([R-kinds-and-tiers]).

Qwen3.5's Gated DeltaNet layers (`linear_attention`) keep, per sequence, the last K - 1 inputs of their causal conv
(q|k|v channels) and the recurrent matrix S [value heads, key dim, value dim]; LFM2's short-conv layers (`conv`) keep
the last K - 1 inputs of theirs. Neither grows with the context: a sequence's state costs the same at 10 tokens and
at 100k, so it is taken from the budget once per batch slot, before the pages are sized (pool_sizing.py), like the
sliding layers' rings. The conv states are kept in the activations' dtype, the recurrent matrices in fp32 (the delta
rule accumulates over the whole sequence; transformers keeps it in fp32 too).

No torch at import time: the planner (`oval-edge plan`) counts these bytes with the same formula the pool allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from .units import format_bytes

STATE_KINDS = ("linear_attention", "conv")
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECURRENT_BYTES = 4  # the delta rule's matrix: fp32 always


@dataclass(frozen=True)
class StateLayer:
    """One state layer's per-sequence shapes: conv [conv_channels, conv_width] (+ recurrent [heads, key_dim,
    value_dim] for linear attention)."""

    layer: int
    kind: str
    conv_channels: int
    conv_width: int  # kernel size - 1: the inputs a causal conv needs from before the current token
    heads: int = 0  # linear attention: value heads of the recurrent matrix; 0 for a conv layer
    key_dim: int = 0
    value_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise ValueError(f"state layer {self.layer}: kind {self.kind!r} is unknown; allowed: "
                             f"{', '.join(STATE_KINDS)}")
        if self.conv_channels < 1 or self.conv_width < 1:
            raise ValueError(f"state layer {self.layer}: a causal conv of {self.conv_channels} channels and kernel "
                             f"{self.conv_width + 1} is not a conv; both must be >= 1 and the kernel >= 2")
        if self.kind == "linear_attention" and min(self.heads, self.key_dim, self.value_dim) < 1:
            raise ValueError(f"state layer {self.layer}: linear attention needs heads, key_dim and value_dim >= 1 "
                             f"(got {self.heads}, {self.key_dim}, {self.value_dim})")

    @property
    def recurrent_elements(self) -> int:
        return self.heads * self.key_dim * self.value_dim


@dataclass(frozen=True)
class StateLayout:
    """Every state layer of a model and the dtype of its conv states."""

    layers: tuple[StateLayer, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in STATE_DTYPE_BYTES:
            raise ValueError(f"state dtype={self.dtype!r} is unknown; allowed: {', '.join(STATE_DTYPE_BYTES)}")
        indices = [s.layer for s in self.layers]
        if not indices or indices != sorted(set(indices)):
            raise ValueError(f"state layers {indices} must be distinct increasing layer indices, at least one")

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.layers)

    @property
    def conv_bytes_per_sequence(self) -> int:
        return sum(s.conv_channels * s.conv_width for s in self.layers) * STATE_DTYPE_BYTES[self.dtype]

    @property
    def recurrent_bytes_per_sequence(self) -> int:
        return sum(s.recurrent_elements for s in self.layers) * RECURRENT_BYTES

    @property
    def bytes_per_sequence(self) -> int:
        return self.conv_bytes_per_sequence + self.recurrent_bytes_per_sequence

    def describe(self) -> str:
        kinds = {kind: sum(1 for s in self.layers if s.kind == kind) for kind in STATE_KINDS}
        named = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in kinds.items() if n)
        return f"{format_bytes(self.bytes_per_sequence)} a sequence ({named} layers)"


def _get(config, name: str, default=None):
    """A transformers-named value of a config object or a config.json dict."""
    if isinstance(config, dict):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def state_layout(config, dtype: str = "float32") -> StateLayout | None:
    """The state layers of a config with transformers' names (`layer_types`; Qwen3.5's linear_num_key_heads,
    linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim; LFM2's hidden_size
    and conv_L_cache), or None for a model without any."""
    types = tuple(_get(config, "layer_types", ()) or ())
    layers = []
    for index, kind in enumerate(types):
        if kind == "linear_attention":
            k_heads, v_heads = int(_get(config, "linear_num_key_heads")), int(_get(config, "linear_num_value_heads"))
            dk, dv = int(_get(config, "linear_key_head_dim")), int(_get(config, "linear_value_head_dim"))
            channels = 2 * k_heads * dk + v_heads * dv  # the conv runs over the q | k | v projections
            width = int(_get(config, "linear_conv_kernel_dim", 4)) - 1
            layers.append(StateLayer(index, kind, channels, width, v_heads, dk, dv))
        elif kind == "conv":
            width = int(_get(config, "conv_L_cache", 3)) - 1
            layers.append(StateLayer(index, kind, int(_get(config, "hidden_size")), width))
    return StateLayout(tuple(layers), dtype) if layers else None
