"""The native CPU kernels (oval_edge/kernels/score_kernels.c, attend_kernels.c) against the torch code they replace, and how they
are built, cached and turned off.

Shapes cover the instantiations the C file specialises (head dim 64 and 128, page sizes 16..64) and the generic
path (head dim 48, page size 128), several group sizes and ranks, bf16 and fp32 pools, and page tables that are
neither sorted nor contiguous.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import torch

from oval_edge.cache_dir import CACHE_ENV
from oval_edge.kernels import cpu as native_kernels
from oval_edge.kernels import cpu_build, cpu_check
from oval_edge.kernels.cpu import NATIVE_ENV, cpu_kernels
from oval_edge.kernels.cpu_check import random_records
from oval_edge.sparse.attention import attend
from oval_edge.sparse.scoring import record_scores

TOL = 2e-5  # fp32 with a different summation order and a 2^x polynomial good to ~1e-7


def _near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = float((actual.double() - expected.double()).abs().max())
    assert error <= TOL * max(1.0, float(expected.abs().max())), f"max abs diff {error:.3g}"


FORMATS = [("float", torch.bfloat16), ("float", torch.float32), ("int8", None), ("int4", None)]


@pytest.mark.parametrize("fmt,dtype", FORMATS, ids=["bf16", "fp32", "int8", "int4"])
@pytest.mark.parametrize(
    "dim,page_size,group,rank",
    [(64, 32, 3, 4), (64, 16, 1, 1), (64, 64, 7, 8), (128, 32, 4, 4), (128, 32, 2, 16), (48, 128, 5, 3),
     (40, 32, 3, 4), (64, 32, 3, 20), (64, 8, 2, 2)],  # the last three: shapes only the plain C body takes
)
def test_page_scores_equal_the_torch_scorer(kernels, fmt, dtype, dim, page_size, group, rank):
    """Every record format, read in place by the kernel, scores as the torch scorer over the decoded records."""
    gen = torch.Generator().manual_seed(dim + page_size + group + rank)
    batch, kv_heads, pages, listed = 2, 3, 40, 17
    q = torch.randn(batch, kv_heads, group, dim, generator=gen)
    records = random_records(gen, kv_heads, pages, rank, dim, page_size, fmt, dtype)
    table = torch.stack([torch.randperm(pages, generator=gen)[:listed] for _ in range(batch)])
    table[1, :3] = table[0, :3]  # two rows may list the same physical page
    scale = dim**-0.5
    expected = record_scores(q, records, table, scale)
    actual = kernels.oval_scores(q, records, table, scale)
    assert actual.shape == (batch, kv_heads, listed) and actual.dtype == torch.float32
    _near(actual, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dim,group,slots", [(64, 3, 224), (64, 1, 5000), (128, 4, 300), (64, 7, 100), (128, 5, 70),
                                             (48, 6, 77)])
def test_attention_over_slots_equals_gather_then_attend(kernels, dtype, dim, group, slots):
    gen = torch.Generator().manual_seed(dim + group + slots)
    batch, kv_heads, rows = 2, 2, 6000
    k_rows = (2 * torch.randn(rows, dim, generator=gen)).to(dtype)
    v_rows = torch.randn(rows, dim, generator=gen).to(dtype)
    flat = torch.randint(0, rows, (batch, kv_heads, slots), generator=gen)
    valid = torch.rand(batch, kv_heads, slots, generator=gen) < 0.8
    valid[..., 0] = True  # every row attends to at least its own token
    q = torch.randn(batch, kv_heads * group, dim, generator=gen)
    shape = (batch, kv_heads, slots, dim)
    k, v = k_rows[flat.reshape(-1)].view(shape), v_rows[flat.reshape(-1)].view(shape)
    expected = attend(q, k, v, valid, dim**-0.5)
    actual = kernels.attend_slots(q, k_rows, v_rows, flat, valid, dim**-0.5)
    _near(actual, expected)


@pytest.mark.parametrize("team,batch,kv_heads", [(2, 1, 3), (4, 1, 3), (3, 2, 2), (2, 2, 3)])
def test_attention_split_over_the_team_equals_gather_then_attend(kernels, monkeypatch, team, batch, kv_heads):
    """Fewer (row, KV head) pairs than a multiple of the team: each pair's slots are split into pieces merged by
    their log-sum-exp; per-row limits end the pieces early, and a piece with no valid slot adds nothing."""
    monkeypatch.setattr(native_kernels, "_team", lambda: team)
    gen = torch.Generator().manual_seed(team * 10 + batch)
    rows, slots, group, dim = 20000, 9000, 3, 64
    k_rows = (2 * torch.randn(rows, dim, generator=gen)).bfloat16()
    v_rows = torch.randn(rows, dim, generator=gen).bfloat16()
    flat = torch.randint(0, rows, (batch, kv_heads, slots), generator=gen)
    valid = torch.rand(batch, kv_heads, slots, generator=gen) < 0.9
    valid[..., 2000:4600] = False  # a whole piece without a valid slot
    valid[..., 0] = True
    limits = torch.tensor([7000, 9000][:batch])
    q = torch.randn(batch, kv_heads * group, dim, generator=gen)
    shape = (batch, kv_heads, slots, dim)
    k, v = k_rows[flat.reshape(-1)].view(shape), v_rows[flat.reshape(-1)].view(shape)
    bounded = valid & (torch.arange(slots) < limits[:, None, None])
    _near(kernels.attend_slots(q, k_rows, v_rows, flat, valid, dim**-0.5, limits=limits),
          attend(q, k, v, bounded, dim**-0.5))


def test_scoring_runs_the_avx2_body_where_the_cpu_has_avx2(kernels):
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        flags = next((line.split() for line in info if line.startswith("flags")), [])
    vector = {"avx2", "fma"} <= set(flags)
    assert kernels.scoring_body == ("plain" if not vector else "avx2 + avx512 int4" if "avx512f" in flags else "avx2")


def test_a_head_with_no_valid_slot_gets_zeros_and_invalid_slots_are_never_read(kernels):
    q = torch.randn(1, 2, 64)
    rows = torch.randn(10, 64).bfloat16()
    flat = torch.tensor([[[3, 10_000], [4, -5]]])  # out-of-range indices sit only on invalid slots
    valid = torch.tensor([[[True, False], [False, False]]])
    out = kernels.attend_slots(q, rows, rows, flat, valid, 0.125)
    torch.testing.assert_close(out[0, 0], rows[3].float())  # one slot: its value row exactly
    assert torch.equal(out[0, 1], torch.zeros(64))


def test_out_of_range_indices_are_errors_not_reads(kernels):
    records = random_records(torch.Generator().manual_seed(0), 1, 4, 2, 64, 32, "float", torch.bfloat16)
    with pytest.raises(ValueError, match=r"page outside 0..3"):
        kernels.oval_scores(torch.zeros(1, 1, 1, 64), records, torch.tensor([[1, 4]]), 1.0)
    rows = torch.zeros(8, 64).bfloat16()
    with pytest.raises(ValueError, match=r"outside the layer's 0..7 rows"):
        kernels.attend_slots(torch.zeros(1, 1, 64), rows, rows, torch.tensor([[[8]]]), torch.tensor([[[True]]]), 1.0)


def test_inputs_the_kernels_do_not_take_fall_back_to_torch(kernels):
    gen = torch.Generator().manual_seed(0)
    fp16 = random_records(gen, 1, 4, 2, 64, 32, "float", torch.float16)
    assert kernels.oval_scores(torch.zeros(1, 1, 1, 64), fp16, torch.tensor([[0]]), 1.0) is None
    wide = random_records(gen, 1, 4, 2, 512, 32, "float", torch.bfloat16)  # head dim above the C limit
    assert kernels.oval_scores(torch.zeros(1, 1, 1, 512), wide, torch.tensor([[0]]), 1.0) is None
    no_scales = random_records(gen, 1, 4, 2, 64, 32, "int8", None)._replace(scales=None)
    assert kernels.oval_scores(torch.zeros(1, 1, 1, 64), no_scales, torch.tensor([[0]]), 1.0) is None


def test_loading_the_kernels_leaves_subnormal_floats_alone(kernels):
    # -ffast-math would link crtfastmath.o, which sets flush-to-zero for the whole process when the library loads.
    assert float(torch.tensor(1e-40) * 1.0) != 0.0


def test_env_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert cpu_kernels() is None


def test_library_is_built_once_into_the_cache_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first = cpu_build.built_library()
    assert first.startswith(str(tmp_path / "kernels")) and os.path.isfile(first)
    stamp = os.stat(first).st_mtime_ns
    assert cpu_build.built_library() == first and os.stat(first).st_mtime_ns == stamp  # not rebuilt
    assert not [p for p in os.listdir(tmp_path / "kernels") if p.startswith(".build-")]  # no staging left over
    assert cpu_check.main([first]) == 0  # the build's check, as its child process runs it


def test_a_compiler_without_openmp_builds_the_pthread_head(monkeypatch, tmp_path):
    """-fopenmp is asked for (the head runs on torch's OpenMP team); a compiler that refuses it still gets a checked
    library, whose head splits its columns over pthreads instead."""
    real = shutil.which("cc") or shutil.which("gcc")
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "unsupported -fopenmp" >&2; '
                       f'exit 1; }}; done\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    built = cpu_build.built_library()
    assert cpu_check.main([built]) == 0
    symbols = subprocess.run(["nm", "-D", built], capture_output=True, text=True).stdout
    assert "GOMP_parallel" not in symbols and "pthread_create" in symbols
    monkeypatch.delenv("CC")
    assert "GOMP_parallel" in subprocess.run(["nm", "-D", cpu_build.built_library()], capture_output=True,
                                             text=True).stdout


def test_missing_compiler_means_torch_ops_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    native_kernels._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="oval_edge.kernels.cpu"):
            assert cpu_kernels() is None
        assert "native CPU kernels unavailable" in caplog.text and "decoding with torch ops" in caplog.text
    finally:
        native_kernels._load.cache_clear()  # the next caller loads the real library again


def test_a_compile_error_is_reported_with_the_compilers_message(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("int oval_scores_f32( {\n")
    monkeypatch.setattr(cpu_build, "SOURCES", (broken, *cpu_build.SOURCES[1:]))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"failed: .*error"):
        cpu_build.built_library()
    assert not os.path.exists(tmp_path / "cache" / "kernels") or not os.listdir(tmp_path / "cache" / "kernels")


def test_a_library_that_disagrees_with_torch_is_not_published(monkeypatch, tmp_path):
    source = cpu_build.SOURCES[0].read_text()  # score_kernels.c
    final = "return (log2f(total) + peak) * LN_2;"  # where both scoring bodies end
    assert final in source
    skewed = tmp_path / "skewed.c"
    skewed.write_text(source.replace(final, "return (log2f(total) + peak) * LN_2 * 1.01f;"))  # every score 1% off
    monkeypatch.setattr(cpu_build, "SOURCES", (skewed, *cpu_build.SOURCES[1:]))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"disagrees with torch: oval_scores"):
        cpu_build.built_library()
    assert not os.listdir(tmp_path / "cache" / "kernels")  # nothing published, staging removed


def test_self_check_rejects_a_kernel_that_disagrees_with_torch(kernels, monkeypatch):
    wrong = kernels.oval_scores
    monkeypatch.setattr(kernels, "oval_scores", lambda *args: wrong(*args) + 1e-2)
    assert cpu_check.self_check(kernels) == "oval_scores float torch.float32"
