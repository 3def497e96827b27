"""The fused CPU kernels of native/oval_kernels.c: compiled once per machine, loaded with ctypes.

Why: on a CPU, eager torch spends most of a long-context decode step on many small passes over the page summaries
(scoring) and on copying selected K/V rows out of the pool (attention). The kernels do each in one pass, reading the
pool in place. They are an optimisation only: `cpu_kernels()` is None (and callers keep their torch code) when
they are turned off (OVAL_EDGE_NATIVE=0), when no C compiler is found, when the build fails, or when the built
library disagrees with the torch reference on a small self-check (run once per build, in a child process).
Nothing else in the process changes.

The library is built with the system C compiler (`$CC`, else cc) for this CPU (-march=native, -mcpu=native on
Arm) into <cache>/kernels/<key>/ (see cache_dir.py), keyed by the source, the compiler, the flags and the CPU's
feature list, checked, and published by an atomic rename, so one that exists is complete and checked.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .cache_dir import cache_root

NATIVE_ENV = "OVAL_EDGE_NATIVE"  # "0": never use the kernels (A/B measurements, debugging)
SOURCE = Path(__file__).with_name("native") / "oval_kernels.c"
LIBRARY_NAME = "oval_kernels.so"
COMPILE_TIMEOUT_S = 120
CHECK_TIMEOUT_S = 300  # the check's child imports torch: seconds, but minutes on a cold, slow board
# -ffast-math's parts that let the compiler vectorise the kernels' sums and maxima, without -ffast-math itself:
# linked into a shared library it pulls in crtfastmath.o, which turns on flush-to-zero for the whole process at load
# (torch's subnormals would silently become 0; hypothesis caught it). The kernels never produce inf or NaN.
OPTIMISE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
                  "-freciprocal-math", "-ffinite-math-only")
SELF_CHECK_TOLERANCE = 1e-4
REFUSED, OUT_OF_RANGE = 1, 2  # the C kernels' return codes: shapes above their fixed limits, an index outside the pool
ELEMENT_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

log = logging.getLogger(__name__)

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64
_SCORE_ARGS = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr]
_ATTEND_ARGS = [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, _ptr]


class NativeKernels:
    """Typed entry points of the loaded library. Each returns None for inputs it does not take (another device
    or dtype, shapes above the limits the C file defines), so the caller runs its torch code instead."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._scores, self._attend = {}, {}
        for dtype, suffix in ELEMENT_SUFFIX.items():
            scores = getattr(library, f"oval_scores_{suffix}")
            scores.argtypes, scores.restype = _SCORE_ARGS, ctypes.c_int
            attend = getattr(library, f"attend_slots_{suffix}")
            attend.argtypes, attend.restype = _ATTEND_ARGS, ctypes.c_int
            self._scores[dtype], self._attend[dtype] = scores, attend

    def oval_scores(self, q: torch.Tensor, basis: torch.Tensor, coords: torch.Tensor, page_table: torch.Tensor,
                    scale: float) -> torch.Tensor | None:
        """scoring.oval_scores over the pages `page_table` [B, Np] lists, reading one layer's summaries in place.

        q [B, Hkv, G, D]; basis U^T [Hkv, pages, r, D]; coords C^T [Hkv, pages, r, P] -> scores [B, Hkv, Np] fp32.
        """
        kernel = self._scores.get(basis.dtype)
        b, hkv, group, dim = q.shape
        _, pages_total, rank, page_size = coords.shape
        if (kernel is None or coords.dtype != basis.dtype or not _on_cpu(q, basis, coords, page_table)
                or not (basis.is_contiguous() and coords.is_contiguous())):
            return None
        q = q.float().contiguous()
        table = page_table.to(torch.int64).contiguous()
        out = torch.empty((b, hkv, table.shape[1]), dtype=torch.float32)
        code = kernel(q.data_ptr(), basis.data_ptr(), coords.data_ptr(), table.data_ptr(), b, hkv, group, dim,
                      rank, page_size, table.shape[1], pages_total, float(scale), out.data_ptr())
        return _result(code, out, "oval_scores", "page table holds a page outside 0..{}", pages_total - 1)

    def attend_slots(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor,
                     valid: torch.Tensor, scale: float) -> torch.Tensor | None:
        """attention.attend over the valid slots of `flat` [B, Hkv, T] (rows of one layer's [rows, D] K and V
        views), reading them in place instead of gathering. q [B, Hq, D] fp32 -> [B, Hq, D]."""
        kernel = self._attend.get(k_rows.dtype)
        b, hq, dim = q.shape
        hkv, slots = flat.shape[1], flat.shape[2]
        if (kernel is None or q.dtype != torch.float32 or v_rows.dtype != k_rows.dtype
                or not _on_cpu(q, k_rows, v_rows, flat, valid)
                or not (k_rows.is_contiguous() and v_rows.is_contiguous())):
            return None
        q = q.contiguous()
        idx = flat.to(torch.int64).contiguous()
        ok = valid.to(torch.bool).contiguous()
        weights = torch.empty(hq // hkv * slots, dtype=torch.float32)  # scratch: one row of logits per query head
        out = torch.empty_like(q)
        code = kernel(q.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(), k_rows.shape[0], idx.data_ptr(),
                      ok.data_ptr(), b, hkv, hq // hkv, dim, slots, float(scale), weights.data_ptr(), out.data_ptr())
        return _result(code, out, "attend_slots", "a valid slot lies outside the layer's 0..{} rows",
                       k_rows.shape[0] - 1)


def describe_kernels(device: torch.device) -> str:
    """Which decode path runs on `device`, for logs and serve's startup report."""
    if device.type != "cpu":
        return "torch ops (the native kernels are CPU-only)"
    kernels = cpu_kernels()
    if kernels is not None:
        return f"native CPU scoring + attention ({kernels.path})"
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return f"torch ops ({NATIVE_ENV}=0)"
    return "torch ops (native kernels unavailable: the log says why)"


def cpu_kernels() -> NativeKernels | None:
    """The kernels, or None when they are off or unavailable (the reason is logged once)."""
    if os.environ.get(NATIVE_ENV, "1").strip() == "0":
        return None
    return _load()


@functools.cache
def _load() -> NativeKernels | None:
    try:
        path = _built_library()
        return NativeKernels(ctypes.CDLL(path), path)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("native CPU kernels unavailable (%s); decoding with torch ops (slower at long context)", exc)
        return None


def _built_library() -> str:
    """The path of this machine's checked library, building and checking it first if the cache has none."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    flags = [*OPTIMISE_FLAGS, "-fPIC", "-shared", *_arch_flags()]
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"|".join([source, version.encode(), " ".join(flags).encode(), _cpu_features().encode()]))
    folder = os.path.join(cache_root(), "kernels", key.hexdigest()[:24])
    path = os.path.join(folder, LIBRARY_NAME)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(folder))
    try:
        built = os.path.join(staging, LIBRARY_NAME)
        done = subprocess.run([compiler, *flags, "-o", built, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-500:]}")
        # Checked in a child process: the torch reference touches code (einsum, softmax, ...) that decoding with the
        # kernels never runs, and those library pages would stay resident in the server (~7 MiB measured).
        check = subprocess.run([sys.executable, "-m", __name__, built], capture_output=True, text=True,
                               timeout=CHECK_TIMEOUT_S)
        if check.returncode != 0:
            tail = (check.stdout + check.stderr).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the built library disagrees with torch or does not load: {tail[0]}")
        try:
            os.rename(staging, folder)  # atomic: a folder that exists holds a complete, checked library
        except OSError:
            if not os.path.isfile(path):  # another process published first, or the cache is unusable
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _cpu_features() -> str:
    """The CPU's feature line (x86 `flags`, Arm `Features`): a library built for one CPU must not load on another
    that shares the cache folder."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _result(code: int, out: torch.Tensor, kernel: str, out_of_range: str, last: int) -> torch.Tensor | None:
    """`out` when the kernel ran; None when it refused the shapes (the caller falls back to torch). The error
    message is formatted only on error: this runs for every layer of every decode step."""
    if code == 0:
        return out
    if code == REFUSED:
        return None
    if code == OUT_OF_RANGE:
        raise ValueError(f"{kernel}: {out_of_range.format(last)}")
    raise RuntimeError(f"{kernel} returned unknown code {code}")


def _self_check(kernels: NativeKernels) -> str | None:
    """Both kernels against the torch code they replace, on a small random case in each pool dtype."""
    from .scoring import oval_scores  # imported here: scoring itself calls cpu_kernels()

    gen = torch.Generator().manual_seed(0)
    hkv, group, dim, rank, page_size, pages = 2, 3, 64, 4, 16, 6
    q = torch.randn(2, hkv, group, dim, generator=gen)
    table = torch.tensor([[4, 1, 3], [0, 5, 2]])
    flat = torch.randint(0, pages * hkv * page_size, (2, hkv, 40), generator=gen)
    valid = torch.rand(2, hkv, 40, generator=gen) < 0.7
    for dtype in ELEMENT_SUFFIX:
        basis = torch.randn(hkv, pages, rank, dim, generator=gen).to(dtype)
        coords = torch.randn(hkv, pages, rank, page_size, generator=gen).to(dtype)
        picked = (basis[:, table].movedim(0, 1), coords[:, table].movedim(0, 1))  # [B, Hkv, Np, r, *]
        want = oval_scores(q, *picked, 0.125)
        got = kernels.oval_scores(q, basis, coords, table, 0.125)
        if got is None or not torch.allclose(got, want, rtol=SELF_CHECK_TOLERANCE, atol=SELF_CHECK_TOLERANCE):
            return f"oval_scores {dtype}"
        k_rows = torch.randn(pages * hkv * page_size, dim, generator=gen).to(dtype)
        v_rows = torch.randn(pages * hkv * page_size, dim, generator=gen).to(dtype)
        k, v = k_rows[flat].float(), v_rows[flat].float()  # [B, Hkv, T, D]
        logits = torch.einsum("bhgd,bhtd->bhgt", q, k) * 0.125
        weights = logits.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
        want = torch.einsum("bhgt,bhtd->bhgd", weights, v).reshape(2, hkv * group, dim)
        got = kernels.attend_slots(q.reshape(2, hkv * group, dim), k_rows, v_rows, flat, valid, 0.125)
        if got is None or not torch.allclose(got, want, rtol=SELF_CHECK_TOLERANCE, atol=SELF_CHECK_TOLERANCE):
            return f"attend_slots {dtype}"
    return None


def main(argv: list[str]) -> int:
    """`python -m oval_edge.native_kernels LIBRARY`: exit 0 if the library agrees with torch (the build's check)."""
    kernels = NativeKernels(ctypes.CDLL(argv[0]), argv[0])
    problem = _self_check(kernels)
    if problem:
        print(f"disagrees with torch: {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
