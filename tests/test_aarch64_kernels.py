"""The CPU kernels as an Orin builds them (aarch64, -mcpu=cortex-a78ae), run under qemu-aarch64 on fixed inputs and
compared with the host's portable build of the same sources on the same inputs (tests/aarch64/cross_kernels.py).

Skipped, saying what to install, where the cross compiler or qemu is missing (CI installs both: .ci/run).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from aarch64.cross_kernels import INSTALL_HINT, build, differences, fma_counts, missing_tools, parse, run

needs_cross_tools = pytest.mark.skipif(bool(missing_tools()),
                                       reason=f"aarch64 cross tools missing ({', '.join(missing_tools())}): "
                                              f"{INSTALL_HINT}")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross")
    return folder, {side: build(folder, side) for side in ("host", "aarch64")}


@needs_cross_tools
def test_the_arm_build_agrees_with_the_host_on_every_kernel(builds):
    folder, harnesses = builds
    (host, host_bodies), (target, bodies) = run(harnesses["host"], "host"), run(harnesses["aarch64"], "aarch64")
    assert len(host) >= 50  # every kernel, in every format and the shapes each body takes
    assert bodies["neon"] == 1 and host_bodies["neon"] == 0  # the Arm side ran the NEON page, the host the plain one
    assert differences(host, target) == []


@needs_cross_tools
def test_the_host_reference_is_checked_against_torch(builds):
    """The reference side is the portable C bodies on the host: the build's own torch check must pass on it."""
    folder, _ = builds
    library = folder / "host" / "oval_kernels.so"
    done = subprocess.run([sys.executable, "-m", "oval_edge.kernels.cpu_check", str(library)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_cross_tools
def test_the_hot_kernels_are_vectorised_on_arm(builds):
    """The hot loops' multiply-adds are vector ones in the Arm objects (fmla), not scalar (fmadd): before the NEON
    bodies the scoring, coarse-bound, attention and 4-bit files were mostly scalar (fmla/fmadd 15/85, 9/71,
    147/531, 0/11; now 64/22, 29/8, 975/45, 64/0 with gcc 12)."""
    folder, _ = builds
    counts = fma_counts(folder / "objects")
    for name in ("score_kernels.c", "attend_kernels.c", "quant_kernels.c", "group_kernels.c"):
        vector, scalar = counts[name]
        assert vector > scalar, f"{name}: {vector} fmla against {scalar} fmadd"


def test_a_kernel_that_drifts_is_named():
    """The comparison catches a result off by 1e-3 relative, a missing result and a page scored on one side only."""
    host, bodies = parse("scores_f32 3 1.0 2.0 -inf\nattend_f32 2 0.5 0.25\nbodies scores=0 neon=1\n")
    assert bodies == {"scores": 0, "neon": 1}
    drifted = {**host, "scores_f32": np.array([1.0, 2.002, -np.inf])}
    assert differences(host, drifted) == ["scores_f32: 2.002 against 2.0 (rtol 0.0001, atol 0.0001)"]
    assert differences(host, {"scores_f32": host["scores_f32"]}) == ["attend_f32: missing on one side"]
    unscored = {**host, "scores_f32": np.array([1.0, -np.inf, -np.inf])}
    assert differences(host, unscored) == ["scores_f32: different shape or unscored entries"]
    assert differences(host, dict(host)) == []
