"""The server's cap on torch's CPU shape caches (runtime/server/serve.py, SHAPE_CACHE_CAPACITY): `serve` sets it
before anything else, an operator's own value wins, and with it prefill matmuls over many distinct row counts keep
the process's RSS bounded where the default caches grew it by hundreds of MiB (the soak's RSS growth,
docs/soak.md)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from oval_edge.runtime.server import serve

# One process runs the bundled model's four prefill projections ([rows, in] x [in, out], in -> out below) through
# the grouped op for ROW_COUNTS distinct row counts and prints its RSS growth: each row count is a new shape for
# every projection, as a prompt of a new length is in the server.
ROW_COUNTS = 120
PROBE = r"""
import json, sys, torch
from oval_edge.kernels.cpu import cpu_kernels
from oval_edge.runtime.model.grouped.layout import quantize_grouped
from oval_edge.runtime.model.grouped.linear import grouped_linear
from oval_edge.runtime.server.serve import bound_shape_caches

if sys.argv[1] == "capped":
    bound_shape_caches()
torch.set_num_threads(1)
kernels = cpu_kernels()
if kernels is None or not kernels.grouped_rounds_inputs:  # only the bf16 prefill matmul caches per shape
    print(json.dumps({"skip": "no AVX512-BF16 grouped body: prefill multiplies in fp32"}))
    sys.exit(0)
generator = torch.Generator().manual_seed(0)
projections = [quantize_grouped(torch.randn(out, width, generator=generator)) + (width,)
               for width, out in ((576, 960), (576, 576), (576, 3072), (1536, 576))]

def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

def prefill(rows):
    for codes, scales, mins, width in projections:
        grouped_linear(torch.randn(rows, width, generator=generator), codes, scales, mins, None, 4)

for rows in (40, 41):  # the op's own first-use costs (kernel load, first matmul) before the first reading
    prefill(rows)
start = rss_mib()
for rows in range(64, 64 + ROW_COUNTS):
    prefill(rows)
print(json.dumps({"growth_mib": rss_mib() - start}))
""".replace("ROW_COUNTS", str(ROW_COUNTS))


def _growth_mib(arm: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in serve.SHAPE_CACHE_CAPACITY}
    done = subprocess.run([sys.executable, "-c", PROBE, arm], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result["growth_mib"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc/self/status")
def test_capped_shape_caches_keep_rss_bounded_over_many_prompt_lengths():
    # Uncapped (torch's defaults, 1,024 entries each) the 480 new shapes grew RSS by ~250 MiB here; capped at 16,
    # by the ~30 MiB that 16 entries hold. The uncapped arm shows this torch caches per shape at all.
    uncapped = _growth_mib("default")
    if uncapped < 100:
        pytest.skip(f"this torch's CPU matmuls grew RSS by only {uncapped:.0f} MiB uncapped: nothing to bound")
    capped = _growth_mib("capped")
    assert capped < 50, (f"RSS grew {capped:.0f} MiB over {ROW_COUNTS} prompt lengths with the caps "
                         f"({uncapped:.0f} MiB without): a shape cache is not bounded by SHAPE_CACHE_CAPACITY")


def _serve_until_port_check(monkeypatch) -> None:
    """Run `serve` with an out-of-range port: it stops (ValueError) before it binds or loads anything."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(ValueError, match="--port 70000 is out of range"):
        serve.run(parser.parse_args(["--port", "70000"]))


def test_serve_caps_the_shape_caches_first(monkeypatch):
    for name in serve.SHAPE_CACHE_CAPACITY:
        monkeypatch.delenv(name, raising=False)
    _serve_until_port_check(monkeypatch)
    assert {name: os.environ.get(name) for name in serve.SHAPE_CACHE_CAPACITY} == serve.SHAPE_CACHE_CAPACITY


def test_an_operators_own_cache_capacity_is_kept(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    _serve_until_port_check(monkeypatch)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == serve.SHAPE_CACHE_CAPACITY["LRU_CACHE_CAPACITY"]
