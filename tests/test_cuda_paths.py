"""The CUDA code paths, exercised on the CPU wherever their logic does not need a GPU (issue: GPU decode).

- Graph capture and replay (runtime/engine/forward/cuda_graph.py): a stand-in backend "replays" by re-running the step into
  the tensors the capture returned, so what is checked is the logic around torch.cuda.CUDAGraph: every bucket is
  captured once at startup while the pool is empty, capture writes nothing but page 0's first rows, later steps
  reuse the same input buffer and the same output tensors, the bucket for a batch is the smallest that holds it,
  and the logits equal the uncaptured step's.
- The activation dtype (bf16 from compute capability 8.0, fp16 below, a flag overrides; the pool follows).
- The batched 4-bit projection (runtime/model/projections.py Chunked4bit): the chunking rule by bytes moved, and
  that chunked calls give the module's own output.
- Fallbacks: CudaGraphs refuses a CPU device with a message; graphs are only used on CUDA with the static step.
The real graphs, the Triton kernels on a GPU and bitsandbytes' CUDA kernels run in `make gpu-check`
(tests/test_gpu.py there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.geometry import decode_graph_bytes
from oval_edge.runtime import EngineConfig
from oval_edge.runtime.engine.forward.cuda_graph import WARMUP_RUNS, CudaGraphs, GraphedStep
from oval_edge.runtime.engine.setup import uses_cuda_graphs
from oval_edge.runtime.model.loader import compute_dtype_for
from oval_edge.runtime.model.projections import Chunked4bit, chunk_rows, weight_bytes_moved

from test_static_step import OVAL, engine_for, prefill, static_step, tiny_folder  # noqa: F401 (fixture)


class ReplayByRerun:
    """The GraphBackend contract without a GPU: capture runs the step once and keeps its outputs; a replay runs it
    again and writes the new values into those same tensors (what a CUDA graph's replay does to its outputs)."""

    def __init__(self) -> None:
        self.warmups = self.captures = 0

    def warmup(self, fn, runs: int) -> None:
        for _ in range(runs):
            fn()
        self.warmups += runs

    def capture(self, fn):
        self.captures += 1
        outputs = fn()

        def replay() -> None:
            for kept, fresh in zip(outputs, fn()):
                kept.copy_(fresh)

        return replay, outputs

    def held_bytes(self) -> int:
        return 0


def test_capture_at_startup_touches_only_page_zero_and_replays_equal_the_eager_step(tiny_folder):
    graphed, plain = engine_for(tiny_folder), engine_for(tiny_folder)
    backend = ReplayByRerun()
    assert graphed.pool.num_free == graphed.pool.num_pages  # capture runs while every page is free
    graphed.static.capture(backend)
    assert graphed.static.graphs.buckets == (1, 2, 4)
    assert backend.captures == 3 and backend.warmups == 3 * WARMUP_RUNS
    k = graphed.pool.k
    assert k[:, 1:].abs().sum() == 0 and k[:, 0].abs().sum() > 0  # the idle inputs wrote page 0 only
    steps = {bucket: graphed.static.step_for(bucket) for bucket in (1, 2, 4)}
    packed = {bucket: step.packed.data_ptr() for bucket, step in steps.items()}
    for engine in (graphed, plain):
        for row, length in enumerate((300, 517, 41)):
            prefill(engine, f"s{row}", length, seed=row)
    outputs = None
    for n in range(6):
        seq_ids = ["s0", "s1", "s2"][: 1 + n % 3]  # buckets 1, 2, 4 (3 rows take the bucket of 4) in turn
        tokens = [100 + n + i for i in range(len(seq_ids))]
        got, stats_g = static_step(graphed, seq_ids, tokens)
        want, stats_p = static_step(plain, seq_ids, tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert stats_g == stats_p
        if len(seq_ids) == 3:
            step = graphed.static.step_for(3)
            assert step is steps[4] and isinstance(step.run.__self__, GraphedStep)
            if outputs is not None:  # the same output tensors every replay, overwritten in place
                assert all(a is b for a, b in zip(step.run.__self__.outputs, outputs))
            outputs = step.run.__self__.outputs
    assert {bucket: step.packed.data_ptr() for bucket, step in steps.items()} == packed
    assert all(step.run.__self__.replays == 2 for step in steps.values())
    with pytest.raises(ValueError, match="exceed max_batch=4"):
        graphed.static.step_for(5)
    assert "CUDA graphs: buckets 1, 2, 4" in graphed.describe_decode_step()


def test_graphs_only_on_cuda_with_the_static_step(tiny_folder):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_cuda_graphs(EngineConfig(), cuda)
    assert not uses_cuda_graphs(EngineConfig(), cpu)
    assert not uses_cuda_graphs(EngineConfig(cuda_graphs=False), cuda)
    assert not uses_cuda_graphs(EngineConfig(decode_step="compiled"), cuda)
    assert not uses_cuda_graphs(EngineConfig(decode_step="eager"), cuda)
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="need a CUDA device"):
        CudaGraphs(cpu)
    engine = engine_for(tiny_folder)  # on a CPU the engine never captures
    assert engine.static.graphs is None and engine.describe_decode_step() == "static step, run eager"
    compiled = engine_for(tiny_folder, decode_step="compiled")
    with pytest.raises(ValueError, match="do not combine"):
        compiled.static.capture(ReplayByRerun())


def test_graph_workspace_grows_with_batch_and_context():
    from oval_edge.geometry import KVGeometry

    geometry = KVGeometry.for_oval(30, 3, 64, OvalConfig(), "float16")
    small = decode_graph_bytes(576, 1536, 9, 49152, geometry, 1, 2048, 2)
    assert 0 < small < decode_graph_bytes(576, 1536, 9, 49152, geometry, 4, 2048, 2)
    assert small < decode_graph_bytes(576, 1536, 9, 49152, geometry, 1, 8192, 2)


@pytest.mark.parametrize("capability,want", [((8, 7), torch.bfloat16), ((9, 0), torch.bfloat16),
                                             ((8, 0), torch.bfloat16), ((7, 2), torch.float16),
                                             ((7, 5), torch.float16)])
def test_activation_dtype_by_compute_capability(capability, want):
    assert compute_dtype_for(torch.device("cuda"), "auto", capability) == want
    assert compute_dtype_for(torch.device("cuda"), "float16", capability) == torch.float16  # the flag wins
    assert compute_dtype_for(torch.device("cuda"), "float32", capability) == torch.float32


def test_activation_dtype_errors_and_the_pool_following_it():
    assert compute_dtype_for(torch.device("cpu")) == torch.float32
    assert compute_dtype_for(torch.device("cpu"), "bfloat16") == torch.bfloat16  # asked for: what CUDA runs
    with pytest.raises(ValueError, match="not supported on the CPU"):
        compute_dtype_for(torch.device("cpu"), "float16")
    with pytest.raises(ValueError, match="unknown; allowed: auto"):
        compute_dtype_for(torch.device("cuda"), "half", (8, 7))
    assert OvalConfig().pool_dtype("cuda", "bfloat16") == "bfloat16"
    assert OvalConfig().pool_dtype("cuda", "float32") == "float16"
    assert OvalConfig().pool_dtype("cuda") == "float16"
    assert OvalConfig(kv_dtype="float32").pool_dtype("cuda", "bfloat16") == "float32"
    assert OvalConfig().pool_dtype("cpu", "bfloat16") == "bfloat16"


def test_serve_flags_reach_the_engine():
    import argparse

    from oval_edge.runtime.server.options import add_engine_arguments, engine_spec

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    spec = engine_spec(parser.parse_args(["--no-cuda-graphs", "--dtype", "float16"]))
    assert spec.engine_config().cuda_graphs is False and spec.dtype == "float16"
    spec = engine_spec(parser.parse_args([]))
    assert spec.engine_config().cuda_graphs is True and spec.dtype == "auto"


def test_chunking_rule_moves_the_fewest_weight_bytes():
    # bnb's fused GEMM: calls of 4 rows (0.5 B per weight each) until 9 calls would cost what dequantizing does.
    assert [chunk_rows(n, True) for n in (1, 2, 4, 5, 8, 32, 33, 64)] == [1, 2, 4, 4, 4, 4, 33, 64]
    # No fused GEMM: one 4-bit GEMV per row up to 8 rows (4 B < 4.5 B), one dequantizing call above.
    assert [chunk_rows(n, False) for n in (1, 2, 8, 9, 16)] == [1, 1, 1, 9, 16]
    table = weight_bytes_moved(8, True, nested=True)  # bnb >= 0.50: gemm_4bit reads the 8-bit absmax in the kernel
    assert table == {"gemv_rows": 8 * (0.5 + 9 / 64), "dequantize": 4.5 + 9 / 64, "fused_chunks": 2 * (0.5 + 1 / 64)}


@pytest.mark.parametrize("fused", [True, False])
def test_chunked_calls_give_the_module_output(fused):
    from oval_edge.runtime.model.quantize import linear4bit

    torch.manual_seed(0)
    module = linear4bit(torch.randn(96, 128, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16), "nf4",
                        torch.float32, torch.device("cpu")).eval()
    chunked = Chunked4bit(module, fused_gemm=fused)
    with torch.no_grad():
        for rows in (1, 3, 8, 12):
            x = torch.randn(rows, 128)
            torch.testing.assert_close(chunked(x), module(x), rtol=1e-5, atol=1e-5)


def test_gpu_check_without_a_device_says_so_and_exits_zero(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "no CUDA device" in done.stdout, done.stdout + done.stderr


def test_gpu_check_summary_reads_bench_json(tmp_path, capsys):
    import json

    from oval_edge.tools import gpu_check

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": [{"engine": "oval", "context": 8192, "decode_tok_s": 210.5,
                                          "ops_per_decode_step": 1, "gpu_kernels_per_decode_step": 1290,
                                          "effective_gb_s": 80.0, "bandwidth_fraction": 0.02}]}))
    figures = gpu_check.bench_figures(str(path), "graphs")
    assert figures[0]["decode_tok_s"] == 210.5 and gpu_check.bench_figures(str(tmp_path / "none.json"), "x") == []
    stage = {"rc": 0, "seconds": 1.0}
    gpu_check.print_summary({"device": {"name": "test"}, "figures": figures, "seconds": 3.0,
                             **{name: stage for name in gpu_check.STAGES_S}})
    out = capsys.readouterr().out
    assert "210.5" in out and "1290" in out and "2.0%" in out


def test_gpu_check_fits_a_ten_minute_device_slot():
    from oval_edge.tools import gpu_check

    # a lent device runs one command for 10 minutes at most; the start and the transfers need the last minute
    assert gpu_check.LIMIT_S == sum(gpu_check.STAGES_S.values()) <= 9 * 60
    assert gpu_check.STAGES_S["tests"] >= 240  # a cold Triton cache compiles every kernel of the tests once
    assert all((Path(__file__).parents[1] / name).exists() for name in gpu_check.TESTS)


def test_four_bit_options_agree_with_the_module():
    from oval_edge.tools.experiments.four_bit_paths import format_rows, measure

    results = measure(torch.device("cpu"), torch.float32, rows=(1, 5), shapes={"small": (128, 128)})
    assert [r["rows"] for r in results] == [1, 5]
    for r in results:
        assert r["chunked_err"] < 1e-5 and r["gemv_rows_err"] < 1e-5 and r["dequantize_err"] < 1e-2
        assert r.get("int4pack_err", 0) < 0.25  # another quantization of the same weight: close, not equal
    assert "chunked" in format_rows(results)
