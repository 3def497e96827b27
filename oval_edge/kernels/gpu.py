"""The Triton GPU kernels (triton_scoring.py, triton_attention.py): typed entry points, their switch, self-check.

Why: on CUDA the torch ops gather every selected K/V row and every listed page record into fresh buffers before
computing on them; the Triton kernels read the pool in place ([R-static-step]). They are an optimisation only:
`gpu_kernels(device)` is None (and callers keep their torch code) when the device is not CUDA, when Triton does
not import (it is optional on a Jetson), when OVAL_EDGE_TRITON=0, or when a small startup self-check against the
torch reference fails; the reason is logged once and shown by `describe_gpu_kernels`. Under TRITON_INTERPRET=1
(Triton's CPU interpreter, used by the tests) the kernels are also offered for CPU tensors.

The first call for a device loads, compiles and checks the kernels (it synchronises): make it before any CUDA graph
capture (serve's startup report does, through describe_kernels).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from oval_edge.kv.records.page_record import record_page_size

TRITON_ENV = "OVAL_EDGE_TRITON"  # "0": never use the Triton kernels (A/B measurements, debugging)
INTERPRET_ENV = "TRITON_INTERPRET"  # "1": Triton runs kernels in its interpreter, on CPU tensors
FLOAT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))

log = logging.getLogger(__name__)


class TritonKernels:
    """Typed entry points with the same contracts as NativeKernels' (oval_edge/kernels/cpu.py). Each returns None
    for inputs it does not take (tensors on different devices, a non-contiguous pool view, a page size that is not
    a power of two), so the caller runs its torch code instead."""

    def __init__(self, scoring, attention, version: str) -> None:
        self._scoring, self._attention = scoring, attention  # the kernel modules (a reload keeps these objects)
        self.version = version

    def oval_scores(self, q: torch.Tensor, records, page_table: torch.Tensor, scale: float,
                    counts: torch.Tensor | None = None, rotation: torch.Tensor | None = None) -> torch.Tensor | None:
        """q [B, Hkv, G, D]; records: page_record.LayerRecords of one layer (any format); page_table [B, Np]
        -> [B, Hkv, Np] fp32. counts [B]: pages at or past counts[b] score -3e38, unread. rotation: the int4
        record's H [D, D] fp32 on q's device, built once by the caller (else built per call)."""
        mean, basis, coords, scales = records
        page = record_page_size(basis, coords)
        present = [t for t in records if t is not None]
        if not (_same_device(q, *present, page_table, counts) and _floats(q)
                and (_floats(mean, basis, coords) or scales is not None)
                and all(t.is_contiguous() for t in present) and (page & (page - 1)) == 0):
            return None
        return self._scoring.oval_scores(q, records, page_table, scale, counts, rotation)

    def quest_scores(self, q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_table: torch.Tensor,
                     scale: float, counts: torch.Tensor | None = None) -> torch.Tensor | None:
        """q [B, Hkv, G, D]; kmin, kmax [pages, Hkv, D] (one layer); page_table [B, Np] -> [B, Hkv, Np] fp32."""
        if not (_same_device(q, kmin, kmax, page_table, counts) and _floats(q, kmin, kmax)
                and kmin.is_contiguous() and kmax.is_contiguous()):
            return None
        return self._scoring.quest_scores(q, kmin, kmax, page_table, scale, counts)

    def grouped_scores(self, *args, **kwargs) -> None:
        """No fused two-level kernel on CUDA yet: None, the caller runs grouped.grouped_scores (torch ops around
        this class's oval_scores)."""
        return None

    def attend_slots(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor,
                     valid: torch.Tensor, scale: float, limits: torch.Tensor | None = None,
                     splits: int | None = None,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """q [B, Hq, D] over the valid slots flat [B, Hkv, T] of one layer's rows [rows, D] -> [B, Hq, D] in q's
        dtype. limits [B]: row b visits only its first limits[b] slots. splits: see triton_attention.split_count.
        scales: (k, v) fp32 [rows] when the rows are int8 codes (kv_dtype='int8'; dequantized in the kernel)."""
        quantized = k_rows.dtype == torch.int8 and v_rows.dtype == torch.int8
        if quantized != (scales is not None) or (quantized and not all(
                s.dtype == torch.float32 and s.is_contiguous() and s.numel() == k_rows.shape[0] for s in scales)):
            return None
        if not (_same_device(q, k_rows, v_rows, flat, valid, limits, *(scales or ()))
                and _floats(q, *(() if quantized else (k_rows, v_rows)))
                and valid.dtype == torch.bool and k_rows.is_contiguous() and v_rows.is_contiguous()):
            return None
        return self._attention.attend_slots(q, k_rows, v_rows, flat, valid, scale, limits, splits, scales)


    def bind_oval_scores(self, records, rotation: torch.Tensor | None = None):
        """oval_scores with one layer's records checked once: a callable (q, page_table, scale, counts) that never
        declines, or None for records the kernel does not read. rotation as in oval_scores."""
        mean, basis, coords, scales = records
        page = record_page_size(basis, coords)
        present = [t for t in records if t is not None]
        if not (_same_device(mean, *present, rotation) and (_floats(mean, basis, coords) or scales is not None)
                and all(t.is_contiguous() for t in present) and (page & (page - 1)) == 0):
            return None
        scoring = self._scoring
        return lambda q, page_table, scale, counts=None: scoring.oval_scores(q, records, page_table, scale, counts,
                                                                            rotation)

    def bind_quest_scores(self, kmin: torch.Tensor, kmax: torch.Tensor):
        """quest_scores with one layer's kmin, kmax checked once: a callable (q, page_table, scale, counts), or
        None for summaries the kernel does not read."""
        if not (_same_device(kmin, kmax) and _floats(kmin, kmax) and kmin.is_contiguous() and kmax.is_contiguous()):
            return None
        scoring = self._scoring
        return lambda q, page_table, scale, counts=None: scoring.quest_scores(q, kmin, kmax, page_table, scale,
                                                                             counts)

    def bind_attend(self, k_rows: torch.Tensor, v_rows: torch.Tensor,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        """attend_slots over one layer's rows (and int8 scales) checked once: a callable (q, flat, valid, scale,
        limits=None) that never declines, or None for rows the kernel does not read."""
        quantized = k_rows.dtype == torch.int8 and v_rows.dtype == torch.int8
        if quantized != (scales is not None) or (quantized and not all(
                s.dtype == torch.float32 and s.is_contiguous() and s.numel() == k_rows.shape[0] for s in scales)):
            return None
        if not (_same_device(k_rows, v_rows, *(scales or ())) and (quantized or _floats(k_rows, v_rows))
                and k_rows.is_contiguous() and v_rows.is_contiguous()):
            return None
        attention = self._attention
        return lambda q, flat, valid, scale, limits=None: attention.attend_slots(q, k_rows, v_rows, flat, valid,
                                                                                scale, limits, None, scales)

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   slots: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> torch.Tensor | None:
        """RoPE of the fused projection's q and k heads, the keys and values written into the pool rows `slots`,
        in one launch (triton_attention.rope_write): qkv [n, (Hq + 2 Hkv) * D]; cos, sin [n, 1, D] -> q [n, Hq, D]."""
        n, dim = qkv.shape[0], k_rows.shape[-1]
        if not (_same_device(qkv, cos, sin, slots, k_rows, v_rows) and _floats(qkv, cos, sin, k_rows, v_rows)
                and qkv.dim() == 2 and qkv.shape[1] == (heads + 2 * kv_heads) * dim and qkv.stride(1) == 1
                and dim % 2 == 0 and all(t.shape == (n, 1, dim) and t.is_contiguous() for t in (cos, sin))
                and slots.dtype == torch.int64 and slots.shape == (n, kv_heads) and slots.is_contiguous()
                and k_rows.is_contiguous() and v_rows.is_contiguous() and v_rows.shape[-1] == dim):
            return None
        return self._attention.rope_write(qkv, cos, sin, heads, kv_heads, slots, k_rows, v_rows)


def gpu_kernels(device: torch.device) -> TritonKernels | None:
    """The Triton kernels for tensors on `device`, or None where they are off or unavailable (logged once)."""
    loaded = _loaded(torch.device(device))
    return loaded if isinstance(loaded, TritonKernels) else None


def describe_gpu_kernels(device: torch.device) -> str:
    """Which decode path runs on a non-CPU `device`, for logs and serve's startup report."""
    loaded = _loaded(torch.device(device))
    if isinstance(loaded, TritonKernels):
        return f"Triton scoring + attention (triton {loaded.version})"
    return f"torch ops ({loaded})"


def _interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "on", "yes")


def _off_reason(device: torch.device) -> str | None:
    """Why no Triton kernel runs for tensors on `device` (switched off, or neither CUDA nor the interpreter)."""
    if os.environ.get(TRITON_ENV, "1").strip() == "0":
        return f"{TRITON_ENV}=0"
    if device.type == "cuda" or (device.type == "cpu" and _interpreting()):
        return None
    return f"the Triton kernels run on CUDA only, not {device.type}"


def _loaded(device: torch.device) -> TritonKernels | str:
    """The kernels, or why not (a short reason for the startup report)."""
    return _off_reason(device) or _load(device.type, _interpreting())


@functools.cache
def _load(device_type: str, interpret: bool) -> TritonKernels | str:
    """Import, compile and check the kernels once per device type (and interpreter mode)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton

        from .triton_kernels import triton_attention, triton_scoring
        from .triton_kernels.triton_check import self_check
    except Exception as exc:  # ImportError, or a Triton that fails on import (no driver, a broken install)
        log.warning("Triton kernels unavailable (%s); decoding with torch ops", exc)
        return f"Triton absent: {exc}"
    kernels = TritonKernels(triton_scoring, triton_attention, ".".join(triton.__version__.split(".")[:2]))
    try:
        problem = self_check(kernels, torch.device(device_type))  # triton_check.py
    except Exception as exc:  # a compile or launch error is a failed check, not a failed server
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    if problem:
        log.warning("Triton kernels disagree with the torch reference (%s); decoding with torch ops", problem)
        return f"self-check failed: {problem}"
    return kernels


def int8_head_kernel(device: torch.device):
    """The int8 head's Triton module (triton_int8_head.py) for tensors on `device` when it is on (OVAL_EDGE_TRITON)
    and passes int8_head_check there, else None (why is logged once). Under TRITON_INTERPRET=1 CPU tensors take it
    too (the tests). The first call per device compiles and synchronises: the loader makes it (CudaInt8Table)."""
    if _off_reason(device) is not None:
        return None
    loaded = load_int8_head(device.type, _interpreting())
    return None if isinstance(loaded, str) else loaded


@functools.cache
def load_int8_head(device_type: str, interpret: bool):
    """Import and check the kernel once per device type: the module, or why not (make gpu-check prints it)."""
    return _checked_module("triton_int8_head", "int8_head_check", "int8 head", torch.device(device_type))


def grouped_linear_kernel(device: torch.device):
    """The grouped-format projection's Triton module (triton_grouped.py) for tensors on `device` when it is on
    (OVAL_EDGE_TRITON) and passes grouped_linear_check there, else None (why is logged once). Under
    TRITON_INTERPRET=1 CPU tensors take it too (the tests). The first call per device compiles and synchronises:
    make it before any CUDA graph capture (when the model is built)."""
    if _off_reason(device) is not None:
        return None
    return _module_or_none(load_grouped_linear(device.type, _interpreting()))


def delta_step_kernel(device: torch.device):
    """The gated delta rule's decode step in Triton (triton_delta.py) for tensors on `device` when it is on
    (OVAL_EDGE_TRITON) and passes delta_step_check there, else None (why is logged once). Under TRITON_INTERPRET=1
    CPU tensors take it too (the tests). Call it when the layers are bound, before any CUDA graph capture."""
    if _off_reason(device) is not None:
        return None
    return _module_or_none(load_delta_step(device.type, _interpreting()))


@functools.cache
def load_delta_step(device_type: str, interpret: bool):
    """Import and check the kernel once per device type: the module, or why not."""
    return _checked_module("triton_delta", "delta_step_check", "delta rule step", torch.device(device_type))


def _module_or_none(loaded):
    """A loader's outcome (a module, or why not) -> the module or None."""
    return None if isinstance(loaded, str) else loaded


@functools.cache
def load_grouped_linear(device_type: str, interpret: bool):
    """Import and check the kernel once per device type: the module, or why not (for a report of the kernels)."""
    return _checked_module("triton_grouped", "grouped_linear_check", "grouped projection", torch.device(device_type))


def _checked_module(name: str, check: str, what: str, device: torch.device):
    """Import the kernel module `name` of this package and run triton_check's `check` on it for `device`: the
    module, or a short reason (a warning logged) when Triton is absent, the kernel fails to compile or launch, or
    it disagrees with its reference."""
    try:
        module = importlib.import_module(f".triton_kernels.{name}", __package__)
    except Exception as exc:  # ImportError, or a Triton that fails on import
        log.warning("Triton %s unavailable (%s); using torch ops", what, exc)
        return f"Triton absent: {exc}"
    try:
        from .triton_kernels import triton_check

        problem = getattr(triton_check, check)(module, device)
    except Exception as exc:  # a compile or launch error is a failed check
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    if problem:
        log.warning("Triton %s disagrees with the torch reference (%s); using torch ops", what, problem)
        return f"self-check failed: {problem}"
    return module


def _same_device(first: torch.Tensor, *others: torch.Tensor | None) -> bool:
    return all(t is None or t.device == first.device for t in others)


def _floats(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in FLOAT_DTYPES for t in tensors)
