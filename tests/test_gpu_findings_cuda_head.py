"""Issue #51, the output head on CUDA: int8 only with its Triton kernel, else 16 bits (counted by `plan`), and a
model whose int8 head runs that kernel can be stored in the weight cache.

Without Triton (a stock JetPack torch) the int8 head's torch fallback expands 2,048 vocabulary rows at a time to
fp32 and runs an fp32 matmul: 17 bytes moved per weight and step against 2 for a 16-bit head. The decision
(embeddings.int8_head_applies) is taken with the kernel lookup stood in for, since no GPU is here; the build's
branches and the plan's bytes are checked on CPU tensors (the table layouts do not depend on the device).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oval_edge.kernels import gpu
from oval_edge.runtime.model import decoder_build, embeddings
from oval_edge.runtime.model.quantize import weight_bytes as held_bytes
from oval_edge.runtime.model.weight_cache.entry import WeightCacheEntry
from oval_edge.tools.plan.model import ModelShape
from oval_edge.tools.plan.weights import weight_bytes as planned

CUDA = torch.device("cuda")
VOCAB, HIDDEN = 1024, 96  # a whole number of the CPU table's 32-row panels: its bytes equal CUDA's unpadded ones


class KERNEL:
    """Stands for the checked Triton head module: the dtypes its tl.dot takes (triton_int8_head.DOT_DTYPES)."""

    DOT_DTYPES = (torch.float16, torch.bfloat16)


def shape(tied: bool) -> ModelShape:
    return ModelShape("t", "-", "llama", 1, HIDDEN, 64, 2, 1, 48, VOCAB, 128, tied, False, "test", 0)


@pytest.mark.parametrize("kernel, dtype, int8", [(None, torch.bfloat16, False), (KERNEL, torch.bfloat16, True),
                                                 (KERNEL, torch.float16, True), (KERNEL, torch.float32, False)])
def test_cuda_takes_the_int8_head_only_with_its_kernel_and_a_dtype_it_takes(monkeypatch, kernel, dtype, int8):
    monkeypatch.setattr(embeddings, "int8_head_kernel", lambda device: kernel)
    assert embeddings.int8_head_applies(HIDDEN, CUDA, dtype) is int8
    assert not embeddings.int8_head_applies(HIDDEN + 1, CUDA, dtype)  # hidden % 32: no table at all
    assert embeddings.int8_table_applies(HIDDEN, CUDA)  # the embedding's gathers stay int8 either way


@pytest.mark.parametrize("tied", [True, False])
def test_plan_counts_a_16_bit_head_on_cuda_without_the_kernel(tied):
    int8 = VOCAB * HIDDEN + VOCAB * (HIDDEN // 32) * 4
    sixteen = VOCAB * HIDDEN * 2
    without, with_kernel = planned(shape(tied), "nf4", "cuda"), planned(shape(tied), "nf4", "cuda", int8_head_kernel=True)
    # tied: one 16-bit table serves both (less than an int8 embedding beside a 16-bit head); untied: int8 + 16 bits
    assert (without.embedding, without.lm_head) == ((sixteen, 0) if tied else (int8, sixteen))
    assert (with_kernel.embedding, with_kernel.lm_head) == ((int8, 0) if tied else (int8, int8))
    assert without.read_per_decode_step - with_kernel.read_per_decode_step == sixteen - int8  # the head's bytes


@pytest.mark.parametrize("tied", [True, False])
def test_the_build_without_the_kernel_holds_the_bytes_the_plan_counts(monkeypatch, tied):
    """decoder_build's embedding/head branch with the head's kernel absent (int8_head_applies False) on CPU tensors:
    a 16-bit head (shared with a 16-bit embedding when tied), and the bytes held are the plan's CUDA bytes."""
    monkeypatch.setattr(decoder_build, "int8_head_applies", lambda hidden, device, dtype: False)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN).to(torch.bfloat16),
               "lm_head.weight": torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)}
    embed, head = decoder_build._embedding_and_head(weights, weights.__getitem__, not tied, "nf4",
                                                    torch.device("cpu"), torch.bfloat16)
    assert isinstance(head, embeddings.StoredHead) and head.weight.dtype == torch.bfloat16
    if tied:
        assert isinstance(embed, embeddings.StoredEmbedding) and head.weight is embed.weight
    else:
        assert isinstance(embed, embeddings.Int8Embedding)
    plan = planned(shape(tied), "nf4", "cuda")
    assert held_bytes(nn.ModuleList([embed, head])) == plan.embedding + plan.lm_head


def test_a_model_with_the_triton_head_active_round_trips_through_the_weight_cache(monkeypatch, tmp_path):
    """The row-major table with its Triton kernel on (Triton's interpreter runs it on CPU tensors) is stored and
    read back: the table names its kernel ("triton") instead of holding the module, and the rebuilt head runs the
    kernel again with the same logits."""
    pytest.importorskip("triton", reason="Triton is not installed (the x86_64 test extra has it)")
    import test_triton_kernels  # noqa: F401  (loads the kernel modules under Triton's interpreter)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(gpu.TRITON_ENV, raising=False)
    gpu.load_int8_head.cache_clear()  # an earlier load outside the interpreter is remembered as failed
    monkeypatch.setattr(embeddings, "int8_head_kernel", gpu.int8_head_kernel)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 64, generator=gen)
    table = embeddings.CudaInt8Table.from_rows(lambda a, b: weight[a:b], *weight.shape, torch.device("cpu"))
    if table.head_kernel is None:
        pytest.skip(f"the Triton head does not load here: {gpu.load_int8_head('cpu', True)}")
    model = nn.ModuleList([embeddings.Int8Embedding(table, torch.float16), embeddings.Int8Head(table, torch.float32)])
    source = tmp_path / "model.gguf"
    source.write_bytes(b"stand-in source")
    entry = WeightCacheEntry.for_load(str(source), "nf4", torch.device("cpu"), torch.float16, torch.float16,
                                      {"int8_head": True}, root=str(tmp_path))
    assert entry.store(model) == ""
    cached, why = entry.load(torch.device("cpu"))
    assert why == "" and cached is not None
    head = cached[1]
    assert head.table is cached[0].table and head.table.kernel == "triton"
    assert head.table.head_kernel is test_triton_kernels.triton_int8_head
    x = torch.randn(3, 64, generator=gen).half()
    assert torch.equal(head(x), model[1](x))
    gpu.load_int8_head.cache_clear()
