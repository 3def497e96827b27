"""The CPU kernels as an Orin builds them (aarch64, -mcpu=cortex-a78ae), run under qemu-aarch64 on fixed inputs and
compared with the host's portable build of the same sources on the same inputs (tests/aarch64/cross_kernels.py).

Skipped, saying what to install, where the cross compiler or qemu is missing (CI installs both: .ci/run).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from aarch64.cross_kernels import INSTALL_HINT, build, differences, missing_tools, parse, run

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
    host, target = run(harnesses["host"], "host"), run(harnesses["aarch64"], "aarch64")
    assert len(host) >= 50  # every kernel, in every format and the shapes each body takes
    assert differences(host, target) == []


@needs_cross_tools
def test_the_host_reference_is_checked_against_torch(builds):
    """The reference side is the portable C bodies on the host: the build's own torch check must pass on it."""
    folder, _ = builds
    library = folder / "host" / "oval_kernels.so"
    done = subprocess.run([sys.executable, "-m", "oval_edge.kernels.cpu_check", str(library)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_kernel_that_drifts_is_named():
    """The comparison catches a result off by 1e-3 relative, a missing result and a page scored on one side only."""
    host = parse("scores_f32 3 1.0 2.0 -inf\nattend_f32 2 0.5 0.25\nbodies scores=0 grouped_rounds=0\n")
    drifted = {**host, "scores_f32": np.array([1.0, 2.002, -np.inf])}
    assert differences(host, drifted) == ["scores_f32: 2.002 against 2.0 (rtol 0.0001, atol 0.0001)"]
    assert differences(host, {"scores_f32": host["scores_f32"]}) == ["attend_f32: missing on one side"]
    unscored = {**host, "scores_f32": np.array([1.0, -np.inf, -np.inf])}
    assert differences(host, unscored) == ["scores_f32: different shape or unscored entries"]
    assert differences(host, dict(host)) == []
