"""`OvalConfig`: every knob of OVAL decode, validated when it is built ([R-pool], [R-oval-decode])."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .geometry import RECORD_FORMATS
from .units import parse_bytes

SCORERS = ("oval", "quest")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
PAGE_SIZE_RANGE = (16, 256)


def _check_int(name: str, value, low: int, high: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer in [{low}, {high}]{why}")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} is out of range: allowed [{low}, {high}]{why}")


# Prompt tokens per prefill step (EngineConfig.prefill_chunk, serve, eval, calibrate, plan, profile). A chunk's
# transients grow with it (its activations, and at long context its queries against the whole history): at 8k on
# SmolLM2, 512 -> 256 lowers peak RSS by ~11 MB for ~3% of prefill speed (measured on the CPU runtime).
DEFAULT_PREFILL_CHUNK = 256

@dataclass(frozen=True)
class OvalConfig:
    """How OVAL pages, selects and attends. All sizes are in tokens unless named ``*_bytes``.

    page_size     tokens per KV page (power of two, 16..256); a page is the unit of selection and allocation.
    top_k         pages selected per KV head at each decode step (besides sink and window).
    sink_pages    leading pages always attended (attention sinks).
    window_min/   the local window of recent tokens always attended; its length is set each step from the
    window_max    entropy of the candidate-page scores (peaked -> window_min, flat -> window_max).
    dense_layers  the first layers attend densely (their attention is broad; selection there costs quality).
    scorer        'oval' (output-aware local basis, [R-page-score]) or 'quest' (per-channel key min/max).
    rank, eta     the oval basis rank r (at most page_size - 1) and the output-aware mix eta (0 = key-only
                  spectral basis; > 0 mixes in the output projection's metric, [R-page-score]). Defaults r = 8, eta = 0:
                  what `oval-edge calibrate` froze on held-out text (docs/oval-index.md).
    group_pages,  two-level scoring (oval_edge/sparse/grouped.py): 0 = flat (every sealed page's record is scored
    top_groups    each step); G > 0 = one coarse record per G pages scored first, then the fine records of the
                  top_groups best groups' pages (and of the unfinished group) only. A row with at most top_groups
                  complete groups keeps them all: flat scoring. Defaults 16 and 8: the fine scan stops growing at
                  128 pages + the unfinished group (at 32k a decode step ~25% shorter than flat, measured; at 8k
                  the same KL as flat, docs/oval-index.md).
    two_level_from  a model whose sequences never pass this many tokens keeps flat scoring and no coarse records
                  (for_context). Default 8192: the measured crossover on the CPU runtime (below it two levels are no
                  faster), so the bundled 8k model scores flat. Scorer 'quest' and the page store
                  (EngineConfig.kv_store) score flat.
    record        how oval page records are stored: 'float' (the pool's dtype), 'int8' or 'int4' (quantized with
                  per-page scales, read in place by the kernels; oval_edge/kv/records/page_record.py). Default 'int4': 0.33x
                  the bytes of a bf16 record at the same rank, the most compact format calibrate keeps within 2% of
                  the float record's attention-output error.
    kv_dtype      dtype of the page pool's K/V: 'auto' = the activations' 16-bit dtype on CUDA, bfloat16 on CPU;
                  'int8' = symmetric absmax int8 with one fp32 scale per token and KV head (oval_edge/kv/int8.py),
                  dequantized inside the attention kernels; summaries and records stay in the 'auto' dtype.
    window_module path of a calibrated output-aware window module (`oval-edge calibrate`): it sets each KV
                  head's window within [window_min, window_max] from the layer's hidden state; None = off.
    reuse_tau     selection reuse (sparse/reuse.py): a row keeps a recent selection of a layer instead of scoring
    reuse_slots   pages when every KV head's query has cosine >= reuse_tau with the one that chose it; reuse_slots
                  selections kept per sequence, layer and KV head (LRU). None = off (the default: see README).
    memory_budget total bytes the process may use for weights + workspace + KV pool (int or '1.5GiB');
                  None lets the runtime ask the device.
    """

    page_size: int = 32
    top_k: int = 4
    sink_pages: int = 1
    window_min: int = 64
    window_max: int = 64
    dense_layers: int = 2
    scorer: str = "oval"
    rank: int = 8
    eta: float = 0.0
    record: str = "int4"
    group_pages: int = 16
    top_groups: int = 8
    two_level_from: int = 8192
    kv_dtype: str = "auto"
    memory_budget: int | str | None = None
    # Reuse of a recent selection when the query barely moved ([R-reuse], oval_edge/sparse/reuse.py); None = off.
    reuse_tau: float | None = None
    reuse_slots: int = 8  # recent selections kept per sequence, layer and KV head (the LRU's size)
    # The calibrated output-aware window module ([R-window-module]; `oval-edge calibrate` writes it); None = off, the
    # window follows the entropy rule above. It sets each KV head's window inside [window_min, window_max].
    window_module: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        ps = self.page_size
        _check_int("page_size", ps, *PAGE_SIZE_RANGE)
        if ps & (ps - 1):
            raise ValueError(
                f"page_size={ps} is not a power of two; use one of 16, 32, 64, 128, 256 "
                "(pages are indexed with shifts and gathered as fixed-size blocks)"
            )
        _check_int("top_k", self.top_k, 0, 4096, " pages per KV head")
        _check_int("sink_pages", self.sink_pages, 0, 64)
        _check_int("window_min", self.window_min, 3, 65536, " tokens (the window never holds fewer than 3)")
        _check_int("window_max", self.window_max, 3, 65536, " tokens")
        if self.window_max < self.window_min:
            raise ValueError(
                f"window_max={self.window_max} is below window_min={self.window_min}; "
                "window_max must be >= window_min"
            )
        _check_int("dense_layers", self.dense_layers, 0, 1024)
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer={self.scorer!r} is unknown; allowed: {', '.join(SCORERS)}")
        _check_int("rank", self.rank, 1, 256, " (the oval basis rank r; at most the head dim)")
        if isinstance(self.eta, bool) or not isinstance(self.eta, (int, float)) or not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"eta={self.eta!r} is out of range: allowed [0.0, 1.0] (0 = key-only basis)")
        if self.record not in RECORD_FORMATS:
            raise ValueError(f"record={self.record!r} is unknown; allowed: {', '.join(RECORD_FORMATS)} (how oval page "
                             "records are stored)")
        if self.group_pages != 0:
            _check_int("group_pages", self.group_pages, 2, 256, " pages per coarse group (0 = flat scoring)")
            if self.scorer != "oval":  # coarse records are oval records: quest always scores flat
                object.__setattr__(self, "group_pages", 0)
        _check_int("top_groups", self.top_groups, 1, 4096, " coarse groups whose pages are scored finely")
        _check_int("two_level_from", self.two_level_from, 0, 1 << 24, " tokens (0 = two levels wherever they apply)")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r} is unknown; allowed: {', '.join(KV_DTYPES)}")
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget, "memory_budget"))
        if self.reuse_tau is not None:
            tau = self.reuse_tau
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau <= 1.0:
                raise ValueError(f"reuse_tau={tau!r} is out of range: allowed (0.0, 1.0], or None to disable reuse")
        _check_int("reuse_slots", self.reuse_slots, 1, 64, " recent selections per sequence, layer and KV head")
        if self.window_module is not None:
            if not isinstance(self.window_module, str) or not self.window_module.strip():
                raise ValueError(f"window_module={self.window_module!r} must be the path of a module file written by "
                                 "`oval-edge calibrate`, or None")
            if self.window_min == self.window_max:
                raise ValueError(f"window_module is set but window_min = window_max = {self.window_min}: the module "
                                 "chooses each head's window inside [window_min, window_max]; widen the range "
                                 "(e.g. window_min=16, window_max=128)")

    # Tokens read per KV head at a sparse decode step: sink + top-k pages + the largest window, where the window
    # slots also cover the open (unsealed) page, so at least page_size of them (= selection.slots_per_step).
    # A sequence no longer than this is attended densely: exact, and no more reads than a sparse step.
    @property
    def token_budget(self) -> int:
        return (self.sink_pages + self.top_k) * self.page_size + max(self.window_max, self.page_size)

    def pool_dtype(self, device_type: str, activations: str | None = None) -> str:
        """The page pool's dtype on a device type ('cpu', 'cuda'): kv_dtype, or for 'auto' on CUDA the activations'
        16-bit dtype when given (bfloat16 on sm_80+: attention then reads K/V without a cast), else float16; on the
        CPU bfloat16 (it halves the pool; attention math still runs in fp32 on the gathered slots)."""
        if self.kv_dtype not in ("auto", "int8"):  # int8: K/V codes; this is then the dtype of everything else
            return self.kv_dtype
        if device_type == "cuda":
            return activations if activations in ("bfloat16", "float16") else "float16"
        return "bfloat16"

    @property
    def kv_int8(self) -> bool:
        """K/V pages stored as int8 codes + per-row scales (pool_dtype then names the summaries' float dtype)."""
        return self.kv_dtype == "int8"

    def for_context(self, max_tokens: int) -> "OvalConfig":
        """This config as it applies to sequences of at most max_tokens tokens: two-level scoring off (group_pages 0)
        where no sequence can pass two_level_from tokens or hold more than top_groups complete groups (every row
        would then keep all of its groups and score flat anyway); the pool then keeps no coarse record slots (their
        bytes go to pages)."""
        if self.group_pages and max_tokens <= max(self.two_level_from, self.top_groups * self.group_pages * self.page_size):
            return self.replace(group_pages=0)
        return self

    def replace(self, **changes) -> "OvalConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict) -> "OvalConfig":
        """Build from a TOML/JSON table; unknown keys are an error that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown OVAL setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {k: v for k, v in out.items() if v is not None}
