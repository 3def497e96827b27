"""The Triton kernels' loader (oval_edge/kernels/gpu.py): the switch, the interpreter on CPU tensors, Triton absent or
failing its self-check means torch ops, and the call sites (score_pages, attend_rows, step_ops) routed through the
kernels or falling back, both equal to the torch reference. The interpreter set-up and the helpers are
test_triton_kernels.py's (importing it sets TRITON_INTERPRET before the kernel modules load)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from test_triton_kernels import BF16, DIM, RANK, _dense, _near, _table  # its import sets up the interpreter
from test_triton_kernels import gpu, triton_attention, triton_check, triton_scoring

from oval_edge.kernels import cpu as native
from oval_edge.kernels.cpu_check import random_records
from oval_edge.kv.records.page_record import layer_records
from oval_edge.sparse import attention, scoring, step_ops
from oval_edge.sparse.attention import attend, gather_rows
from oval_edge.sparse.scoring import quest_scores


@pytest.fixture
def fresh_loader(monkeypatch):
    """gpu._load's cache emptied before and after (it caches the outcome per device type and interpreter mode)."""
    monkeypatch.delenv(gpu.TRITON_ENV, raising=False)
    gpu._load.cache_clear()
    yield
    gpu._load.cache_clear()


def test_the_interpreter_offers_checked_kernels_for_cpu_tensors(fresh_loader, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = gpu.gpu_kernels(torch.device("cpu"))
    assert isinstance(kernels, gpu.TritonKernels)
    assert gpu.describe_gpu_kernels(torch.device("cpu")).startswith("Triton scoring + attention (triton ")


def test_no_kernels_for_cpu_tensors_outside_the_interpreter(fresh_loader, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert gpu.gpu_kernels(torch.device("cpu")) is None
    assert gpu.gpu_kernels(torch.device("meta")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(gpu.TRITON_ENV, "0")
    assert gpu.gpu_kernels(torch.device("cpu")) is None
    assert gpu.describe_gpu_kernels(torch.device("cpu")) == f"torch ops ({gpu.TRITON_ENV}=0)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes this machine's CUDA, which it has")
def test_describe_on_cuda_without_cuda(fresh_loader):
    assert native.describe_kernels(torch.device("cuda")) == "torch ops (CUDA is not available)"


def test_triton_absent_or_failing_its_check_means_torch_ops(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        assert gpu.gpu_kernels(torch.device("cpu")) is None
        assert gpu.describe_gpu_kernels(torch.device("cpu")).startswith("torch ops (Triton absent: ")
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1  # logged once
    monkeypatch.undo()
    gpu._load.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_check, "self_check", lambda kernels, device: "oval_scores torch.float16")
    assert gpu.describe_gpu_kernels(torch.device("cpu")) == "torch ops (self-check failed: oval_scores torch.float16)"
    gpu._load.cache_clear()

    def broken(kernels, device):
        raise RuntimeError("PTX for sm_87 failed\nmore")

    monkeypatch.setattr(triton_check, "self_check", broken)
    expected = "torch ops (self-check failed: RuntimeError: PTX for sm_87 failed)"  # the message's first line
    assert gpu.describe_gpu_kernels(torch.device("cpu")) == expected


def _decode_inputs():
    """One layer of pool-shaped records and rows (bf16), a padded batch of 3 with counts and limits."""
    gen = torch.Generator().manual_seed(11)
    layers, hkv, group, page, pages = 2, 3, 3, 16, 10
    per_layer = [random_records(gen, hkv, pages, RANK, DIM, page, "float", BF16) for _ in range(layers)]
    keys = torch.randn(layers, pages, hkv, page, DIM, generator=gen).to(BF16)
    summaries = {name: torch.stack([getattr(r, name) for r in per_layer]) for name in ("mean", "basis", "coords")}
    summaries.update(kmin=keys.amin(3), kmax=keys.amax(3))
    table, counts = _table(gen, 3, 5, pages)
    q = torch.randn(3, hkv * group, DIM, generator=gen)
    flat, valid, limits = _dense(gen, 3, hkv, page, pages)
    return dict(summaries=summaries, keys=keys, values=keys.flip(0), table=table, counts=counts, q=q, flat=flat,
                valid=valid, limits=limits, hkv=hkv)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_score_pages_and_attend_rows_route_through_the_kernels_or_fall_back(path, monkeypatch):
    """The call sites (score_pages, attend_rows, step_ops' operator bodies) with the Triton kernels standing in for a
    CUDA device's, and with no kernels at all (Triton absent, native kernels off): both equal the torch reference."""
    if path == "triton":
        kernels = gpu.TritonKernels(triton_scoring, triton_attention, "interpreted")
    else:
        kernels = None
        monkeypatch.setattr(gpu, "_load", lambda device_type, interpret: "Triton absent: test")
        monkeypatch.setenv(native.NATIVE_ENV, "0")
        assert native.decode_kernels(torch.device("cpu")) is None
    for module in (scoring, attention):
        monkeypatch.setattr(module, "decode_kernels", lambda device: kernels)
    c = _decode_inputs()
    layer, scale, table, counts = 1, DIM**-0.5, c["table"], c["counts"]
    grouped = scoring.group_queries(c["q"], c["hkv"])
    listed = (torch.arange(table.shape[1]) < counts[:, None])[:, None].expand(-1, c["hkv"], -1)
    s = c["summaries"]
    want = {"oval": scoring.record_scores(grouped, layer_records(s, layer), table, scale),
            "quest": quest_scores(grouped, s["kmin"][layer][table].float(), s["kmax"][layer][table].float(), scale)}
    for scorer in ("oval", "quest"):
        got = scoring.score_pages(scorer, grouped, s, layer, table, scale, counts)
        _near(got[listed], want[scorer][listed], 1e-4)
    got = step_ops._page_scores(grouped, s["mean"], s["basis"], s["coords"], None, layer, table, counts, scale)
    _near(got[listed], want["oval"][listed], 1e-4)
    k_rows, v_rows = c["keys"][layer].reshape(-1, DIM), c["values"][layer].reshape(-1, DIM)
    bounded = c["valid"] & (torch.arange(c["flat"].shape[-1]) < c["limits"][:, None, None])
    k, v = gather_rows(k_rows, v_rows, c["flat"])
    want = attend(c["q"], k.float(), v.float(), bounded, scale)
    _near(attention.attend_rows(c["q"], k_rows, v_rows, c["flat"], c["valid"], scale, c["limits"]), want, 1e-4)
    got = step_ops._attend_slots(c["q"], c["keys"], c["values"], layer, c["flat"], c["valid"], c["limits"], scale)
    _near(got, want, 1e-4)
