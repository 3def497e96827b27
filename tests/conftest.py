"""Test-session settings.

One intra-op thread per process (set before torch is imported, and inherited by the servers and workers the
tests start): the suite's work is many small tensor ops, where a second thread mostly waits, and on a shared
2-core machine two spinning threads per process stall each other. Timing is measured by `oval-edge bench`,
never by tests, so this changes no result.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# The weight cache is off for the suite (the servers it starts inherit this): each test's tmp model would leave its
# entry in the user's cache. tests/test_weight_cache.py turns it on under a tmp OVAL_EDGE_CACHE.
os.environ.setdefault("OVAL_EDGE_WEIGHT_CACHE", "0")

import pytest  # noqa: E402  (after the thread settings above)


@pytest.fixture(params=["native", "torch"])
def decode_kernels(request, monkeypatch):
    """Run a test once through the native CPU kernels and once through the torch ops they replace."""
    from oval_edge.kernels.cpu import NATIVE_ENV, cpu_kernels

    if request.param == "torch":
        monkeypatch.setenv(NATIVE_ENV, "0")
    else:
        monkeypatch.delenv(NATIVE_ENV, raising=False)
        if cpu_kernels() is None:
            pytest.skip("native CPU kernels unavailable here (no C compiler?); the torch run covers this test")
    return request.param


@pytest.fixture(scope="module")
def kernels():
    """The loaded native CPU kernels; the test is skipped where they are off or cannot be built."""
    from oval_edge.kernels.cpu import NATIVE_ENV, cpu_kernels

    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        pytest.skip(f"{NATIVE_ENV}=0")
    loaded = cpu_kernels()
    if loaded is None:
        pytest.skip("native CPU kernels unavailable here (no C compiler?)")
    return loaded
