"""The CPU kernels built for the Orin's Arm core and checked under qemu, without a board.

The library is cross-compiled for aarch64 exactly as cpu_build builds it on a board (library_flags, with
-mcpu=cortex-a78ae for -mcpu=native), kernel_harness.c is linked against it and run under qemu-aarch64; the same
harness linked against a host build of the portable C bodies (which the host checks against torch: cpu_check) gives
the reference for the same inputs. Also counts the vector (fmla) and scalar (fmadd) multiply-adds per kernel file in
the aarch64 objects: how much of each file the Arm build vectorises.

`python tests/aarch64/cross_kernels.py` prints the comparison, the counts and the time taken.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from oval_edge.kernels import cpu_build

HARNESS = Path(__file__).with_name("kernel_harness.c")
KERNELS = Path(cpu_build.__file__).parent  # the headers the sources include
CROSS_CC = "aarch64-linux-gnu-gcc"
CROSS_OBJDUMP = "aarch64-linux-gnu-objdump"
EMULATOR = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's gcc-aarch64-linux-gnu: the target's libc, libgomp, loader
BOARD_FLAGS = ["-mcpu=cortex-a78ae"]  # Orin's core (armv8.2-a + dotprod, fp16): what -mcpu=native picks there
INSTALL_HINT = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
RUN_TIMEOUT_S = 300
# Both sides sum in fp32 in different orders; the int8 and 4-bit projections round their output to bf16, so two
# sums on either side of a rounding boundary differ by one bf16 step (2^-8 relative).
TOLERANCE = {"gemv_4bit": (2.0 ** -7, 1e-6)}
DEFAULT_TOLERANCE = (1e-4, 1e-4)


def missing_tools() -> list[str]:
    """The cross tools this check needs that are not installed."""
    return [tool for tool in (CROSS_CC, CROSS_OBJDUMP, EMULATOR) if shutil.which(tool) is None]


def build(folder: Path, target: str) -> Path:
    """The library and the harness linked to it, for target 'aarch64' (cross) or 'host' (portable bodies: no
    -march, so none of the x86 vector bodies). Returns the harness; raises RuntimeError with the compiler's errors."""
    compiler = CROSS_CC if target == "aarch64" else (shutil.which("cc") or "gcc")
    out = folder / target
    out.mkdir(parents=True, exist_ok=True)
    library = out / cpu_build.LIBRARY_NAME
    steps = [cpu_build.compile_command(compiler, cpu_build.library_flags(BOARD_FLAGS if target == "aarch64" else []),
                                       str(library)),
             [compiler, "-O2", "-o", str(out / "harness"), str(HARNESS), str(library), f"-Wl,-rpath,{out}"]]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True, timeout=cpu_build.COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{target} build failed: {cpu_build.failure_reason(done.stderr + done.stdout)}")
    return out / "harness"


def run(harness: Path, target: str) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The harness's results by name and the bodies it was built with (aarch64: under qemu with the cross
    sysroot)."""
    command = [EMULATOR, "-L", SYSROOT, str(harness)] if target == "aarch64" else [str(harness)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"the {target} harness failed ({done.returncode}): "
                           f"{cpu_build.failure_reason(done.stdout + done.stderr)}")
    return parse(done.stdout)


def parse(text: str) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """`name count v0 v1 ...` lines -> {name: values}; the `bodies key=value ...` line (which bodies the build
    compiled in: they differ between the two sides by design) -> {key: value}."""
    results, bodies = {}, {}
    for line in text.splitlines():
        name, *fields = line.split()
        if name == "bodies":
            bodies.update((key, int(value)) for key, value in (field.split("=") for field in fields))
            continue
        values = np.array([float(v) for v in fields[1:]], dtype=np.float64)
        if len(values) != int(fields[0]):
            raise ValueError(f"harness line {name!r}: {len(values)} values, {fields[0]} announced")
        results[name] = values
    return results, bodies


def differences(host: dict[str, np.ndarray], target: dict[str, np.ndarray]) -> list[str]:
    """One line per result that is missing on either side or differs beyond its tolerance (empty: they agree).
    Unscored pages (-inf) must be unscored on both sides."""
    problems = [f"{name}: missing on one side" for name in sorted(set(host) ^ set(target))]
    for name in sorted(set(host) & set(target)):
        want, got = host[name], target[name]
        rtol, atol = next((t for prefix, t in TOLERANCE.items() if name.startswith(prefix)), DEFAULT_TOLERANCE)
        if want.shape != got.shape or not np.array_equal(np.isinf(want), np.isinf(got)):
            problems.append(f"{name}: different shape or unscored entries")
            continue
        finite = np.isfinite(want)
        error = np.abs(got[finite] - want[finite]) - rtol * np.abs(want[finite])
        if error.size and error.max() > atol:
            worst = int(np.argmax(error))
            problems.append(f"{name}: {float(got[finite][worst])!r} against {float(want[finite][worst])!r} "
                            f"(rtol {rtol}, atol {atol})")
    return problems


def fma_counts(folder: Path) -> dict[str, tuple[int, int]]:
    """Per kernel file: (vector fmla, scalar fmadd) instructions in its aarch64 object, built with the library's
    flags."""
    counts = {}
    folder.mkdir(parents=True, exist_ok=True)
    flags = [f for f in cpu_build.library_flags(BOARD_FLAGS) if f != "-shared"]
    for source in cpu_build.SOURCES:
        obj = folder / f"{source.stem}.o"
        command = [CROSS_CC, *flags, f"-I{KERNELS}", "-c", str(source), "-o", str(obj)]
        subprocess.run(command, check=True, capture_output=True, timeout=cpu_build.COMPILE_TIMEOUT_S)
        text = subprocess.run([CROSS_OBJDUMP, "-d", str(obj)], check=True, capture_output=True, text=True).stdout
        counts[source.name] = (len(re.findall(r"\tfmla\s", text)), len(re.findall(r"\tfmadd\s", text)))
    return counts


def main(folder: Path) -> int:
    if missing_tools():
        print(f"missing {', '.join(missing_tools())}: {INSTALL_HINT}")
        return 2
    start = time.perf_counter()
    (host, _), (target, bodies) = (run(build(folder, side), side) for side in ("host", "aarch64"))
    problems = differences(host, target)
    print(f"{len(host)} results compared, {len(problems)} differ ({time.perf_counter() - start:.1f} s); "
          f"aarch64 bodies: {bodies}")
    print("\n".join(problems))
    for name, (vector, scalar) in fma_counts(folder).items():
        print(f"{name:20s} fmla {vector:4d}  fmadd {scalar:4d}")
    return 1 if problems else 0


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(main(Path(scratch)))
