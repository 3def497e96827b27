"""Build the CPU kernels once per machine: the C files below compiled for this CPU, checked, cached.

The library is built with the system C compiler (`$CC`, else cc) for this CPU (-march=native, -mcpu=native on
Arm) into <cache>/kernels/<key>/ (see oval_edge/cache_dir.py), keyed by the source, the compiler, the flags and the
CPU's feature list, checked against torch in a child process (cpu_check.py), and published by an atomic rename, so
one that exists is complete and checked. No torch here: the check imports it, in its own process.

The SIMD body each kernel runs is chosen by the compiler flags (#if __AVX2__, __AVX512F__, __ARM_NEON in the C
files), so a body is a build: `built_library(body)` builds one of BODIES instead of this CPU's own (-march=native)
with the same sources, check and cache, for the parity grid (tests/test_parity_grid.py) and A/B runs
(OVAL_EDGE_NATIVE_BODY, kernels/cpu.py).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from oval_edge.cache_dir import cache_root

# The C files built into the one library: page scoring (flat, and two-level); decode attention; the static step's
# small fused ops; the 8-bit output head; the 4-bit projections where bitsandbytes has no fused CPU kernel; the
# grouped integer projections (a GGUF's own blocks). HEADERS:
# what they include (hashed into the cache key with them).
SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("score_kernels.c", "group_kernels.c", "attend_kernels.c", "step_kernels.c", "head_kernels.c",
                 "quant_kernels.c", "grouped_kernels.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("kernel_math.h", "score_avx2.h", "score_int4_avx512.h",
                                                                       "attend_avx2.h", "group_avx512.h",
                                                                       "grouped_bf16.h", "kernel_neon.h",
                                                                       "score_neon.h", "grouped_neon.h"))
LIBRARY_NAME = "oval_kernels.so"
CHECK_MODULE = "oval_edge.kernels.cpu_check"  # run as `python -m`: exits 0 when the library agrees with torch
COMPILE_TIMEOUT_S = 120
CHECK_TIMEOUT_S = 300  # the check's child imports torch: seconds, but minutes on a cold, slow board
# -ffast-math's parts that let the compiler vectorise the kernels' sums and maxima, without -ffast-math itself:
# linked into a shared library it pulls in crtfastmath.o, which turns on flush-to-zero for the whole process at load
# (torch's subnormals would silently become 0; hypothesis caught it). The kernels never produce inf or NaN.
OPTIMISE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
                  "-freciprocal-math", "-ffinite-math-only")


# A failure's lines worth reporting (failure_reason): compiler errors, a traceback's exception, the check's verdict.
REASON_WORDS = ("error", "disagrees with torch", "undefined reference")
REASON_CHARS = 2000
NATIVE_BODY = "native"  # this CPU's own build (-march=native / -mcpu=native): what the engine loads by default
# x86-64 bodies by name: the -march level that selects them (x86-64-v3: AVX2 + FMA + F16C; v4: AVX-512 F/BW/CD/DQ/
# VL, the int4 scorer's 512-bit body) and the CPU features a library built so needs to run.
BODIES = {
    "portable": ("-march=x86-64", frozenset()),
    "avx2": ("-march=x86-64-v3", frozenset({"avx2", "fma", "f16c"})),
    "avx512": ("-march=x86-64-v4", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                              "avx512dq", "avx512cd"})),
}


def runnable_bodies() -> tuple[str, ...]:
    """The BODIES this machine can build and run (none off x86-64: an Arm build has NEON in every body)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    features = set(_cpu_features().split())
    return tuple(name for name, (_, needs) in BODIES.items() if needs <= features)


def built_library(body: str = NATIVE_BODY) -> str:
    """The path of this machine's checked library, building and checking it first if the cache has none. body: one
    of BODIES to build that SIMD body instead of this CPU's own (ValueError for a body this CPU cannot run)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    # -fopenmp: the head runs on torch's OpenMP team (head_kernels.c says why); a compiler without it builds the
    # pthread version instead (retried without the flag).
    flags = library_flags(_body_flags(body))
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"|".join([source, compiler.encode(), version.encode(), " ".join(flags).encode(),
                                   _cpu_features().encode()]))
    folder = os.path.join(cache_root(), "kernels", key.hexdigest()[:24])
    path = os.path.join(folder, LIBRARY_NAME)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(folder))
    try:
        built = os.path.join(staging, LIBRARY_NAME)
        done = _compile(compiler, flags, built)
        if done.returncode != 0:  # no OpenMP in this compiler: the pthread build
            done = _compile(compiler, [f for f in flags if f != "-fopenmp"], built)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {failure_reason(done.stderr + done.stdout)}")
        # Checked in a child process: the torch reference touches code (einsum, softmax, ...) that decoding with the
        # kernels never runs, and those library pages would stay resident in the server (~7 MiB measured).
        check = subprocess.run([sys.executable, "-m", CHECK_MODULE, built], capture_output=True, text=True,
                               timeout=CHECK_TIMEOUT_S)
        if check.returncode != 0:
            raise RuntimeError(f"the built library disagrees with torch or does not load (the check exited "
                               f"{check.returncode}): {failure_reason(check.stdout + chr(10) + check.stderr)}")
        try:
            os.rename(staging, folder)  # atomic: a folder that exists holds a complete, checked library
        except OSError:
            if not os.path.isfile(path):  # another process published first, or the cache is unusable
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def library_flags(arch_flags: list[str]) -> list[str]:
    """The compiler flags of the library for a CPU named by arch_flags (this machine's: -march=native / -mcpu=native;
    tests/aarch64 cross-builds with -mcpu=cortex-a78ae, the Orin's core)."""
    return [*OPTIMISE_FLAGS, "-fPIC", "-shared", "-pthread", "-fopenmp", *arch_flags]


def compile_command(compiler: str, flags: list[str], built: str) -> list[str]:
    """The command line that compiles SOURCES with flags into `built`."""
    include = f"-I{Path(__file__).parent}"  # the headers, for sources compiled from elsewhere too (the tests' copies)
    return [compiler, *flags, include, "-o", built, *map(str, SOURCES), "-lm"]


def failure_reason(output: str) -> str:
    """What a failed compile or self-check said, for its error message: the lines that name an error or the check's
    verdict, in order (a compiler's `error:` lines, a traceback's exception, "disagrees with torch: ..."), else the
    whole output. Why not the last line: the last line is whatever printed last (a oneDNN warning under qemu hid
    the real reason). Trimmed to REASON_CHARS from the start, where the first error is."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    named = [line for line in lines if any(word in line.lower() for word in REASON_WORDS)]
    reason = "\n".join(named or lines) or "no output"
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + " ..."


def _compile(compiler: str, flags: list[str], built: str) -> subprocess.CompletedProcess:
    return subprocess.run(compile_command(compiler, flags, built), capture_output=True, text=True,
                          timeout=COMPILE_TIMEOUT_S)


def _body_flags(body: str) -> list[str]:
    """The architecture flags that build `body`: this CPU's own for NATIVE_BODY, else the named x86-64 level."""
    if body == NATIVE_BODY:
        return _arch_flags()
    if body not in runnable_bodies():
        allowed = ", ".join((NATIVE_BODY, *runnable_bodies()))
        raise ValueError(f"kernel body {body!r} cannot be built and run on this CPU; choose one of: {allowed}")
    return [BODIES[body][0]]


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
