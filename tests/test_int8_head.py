"""The 8-bit embedding and output head (runtime/model/embeddings.py, oval_edge/kernels/head_kernels.c).

The table is checked against an independent Q8_0-style quantization (absmax / 127 per 32 weights), the native
kernel against the dequantized matmul and against the module's torch fallback, the logits against an error bound
that follows from the quantization step, and a loaded 4-bit model must hold one table when tied and two when not.
"""

from __future__ import annotations

import pytest
import torch

from oval_edge.runtime.model import embeddings as int8_table
from oval_edge.runtime.model.embeddings import Int8Embedding, Int8Head, Int8Table, int8_table_applies

needs_kernels = pytest.mark.skipif(not int8_table.int8_table_applies(32, torch.device("cpu")),
                                   reason="the native CPU kernels are unavailable here")


def q8_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, per-weight half quantization step), written without the module's code."""
    blocks = weight.float().view(weight.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round()
    return (codes * scale).view_as(weight), (scale / 2).expand_as(blocks).reshape(weight.shape)


def test_table_rows_are_the_q8_blocks_and_padding_is_invisible():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 64, generator=gen)  # 100 rows: the last panel is padded with 28 zero rows
    weight[7] = 0.0  # an all-zero row: scale 0, codes 0, no division by zero
    table = Int8Table.quantize(weight.bfloat16())
    assert table.codes.shape == (4, 64, 32) and table.scales.shape == (4, 2, 32)
    want, _ = q8_reference(weight.bfloat16())
    ids = torch.tensor([0, 7, 31, 32, 99, 63, 0])
    assert torch.allclose(table.lookup(ids), want[ids], rtol=0, atol=1e-6)
    assert torch.equal(table.lookup(torch.tensor([7])), torch.zeros(1, 64))
    embed = Int8Embedding(table, torch.float32)
    assert embed(ids.view(7, 1)).shape == (7, 1, 64)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 9, 20])
def test_kernel_equals_dequantized_matmul_and_the_fallback(rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen) * 0.05
    table = Int8Table.quantize(weight)
    dense = table.lookup(torch.arange(200))  # [200, 96] the table's own values
    x = torch.randn(rows, 96, generator=gen)
    head = Int8Head(table, torch.float32)
    got = head(x)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    assert torch.allclose(got, x @ dense.T, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(int8_table, "cpu_kernels", lambda: None)
    assert torch.allclose(head(x), got, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_logits_stay_within_the_quantization_bound():
    """|x W^T - x Wq^T| <= sum_k |x_k| * step_k / 2 per logit: the only error is the codes' rounding."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(512, 128, generator=gen) * 0.1
    x = torch.randn(4, 128, generator=gen)
    got = Int8Head(Int8Table.quantize(weight), torch.float32)(x)
    _, half_step = q8_reference(weight)
    bound = x.abs() @ half_step.T + 1e-5
    assert bool(((got - x @ weight.T).abs() <= bound).all())


@needs_kernels
def test_head_traces_whole_under_torch_compile():
    table = Int8Table.quantize(torch.randn(64, 64))
    head = Int8Head(table, torch.float32)
    x = torch.randn(3, 64)
    compiled = torch.compile(head, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(x), head(x))


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_a_loaded_4bit_model_holds_one_table_when_tied(tied):
    import transformers

    from oval_edge.runtime.model.config import DecoderConfig
    from oval_edge.runtime.model.decoder_build import build_decoder
    from oval_edge.runtime.model.quantize import weight_bytes

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=300,
                                      max_position_embeddings=128, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    state = model.state_dict()

    class Weights:  # the weight-stream interface build_decoder reads
        path = "tiny"

        def names(self):
            return [n for n in state if not (tied and n == "lm_head.weight")]

        def read(self, name, dtype):
            return state[name].to(dtype)

    decoder = build_decoder(Weights(), DecoderConfig.from_dict(config.to_dict(), "tiny"), "nf4",
                            torch.device("cpu"), torch.float32, torch.bfloat16)
    embed, head = decoder.model.embed_tokens, decoder.lm_head
    assert isinstance(embed, Int8Embedding) and isinstance(head, Int8Head)
    assert (embed.table is head.table) == tied
    table_bytes = 320 * 128 + 320 * 4 * 4  # vocab padded to 320 rows: codes + one fp32 scale per 32
    linears = weight_bytes(torch.nn.ModuleList(list(decoder.model.layers) + [decoder.model.norm]))
    assert weight_bytes(decoder) - linears == table_bytes * (1 if tied else 2)
    ids = torch.tensor([5, 299])
    want = model.lm_head.weight.detach() if not tied else model.model.embed_tokens.weight.detach()
    assert torch.allclose(head(embed(ids)), embed(ids) @ q8_reference(want.bfloat16())[0].T, atol=1e-4)


@needs_kernels
def test_lookup_kernel_equals_the_torch_gather_and_refuses_ids_outside_the_vocabulary(monkeypatch):
    table = Int8Table.quantize(torch.randn(70, 64, generator=torch.Generator().manual_seed(3)))
    ids = torch.tensor([69, 0, 33, 33, 5])
    got = table.lookup(ids)
    for bad in (torch.tensor([70]), torch.tensor([-1])):  # 70 is inside the padded panel, still not a token
        with pytest.raises(IndexError, match="outside the vocabulary 0..69"):
            table.lookup(bad)
    monkeypatch.setattr(int8_table, "cpu_kernels", lambda: None)
    assert torch.equal(table.lookup(ids), got)
    with pytest.raises(IndexError, match="outside the vocabulary 0..69"):
        table.lookup(torch.tensor([70]))


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_tables_built_from_file_slices_equal_the_whole_tensor_quantized(tmp_path, source):
    """The loader builds the table PACK_ROWS rows at a time from the file (no 16-bit copy of the whole matrix):
    the same codes and scales as quantizing the tensor read whole."""
    from safetensors.torch import save_file

    from oval_edge.runtime.model import embeddings
    from oval_edge.runtime.model.weight_stream import GGUFWeights, SafetensorsWeights

    weight = torch.randn(embeddings.PACK_ROWS + 70, 64, generator=torch.Generator().manual_seed(5))
    if source == "safetensors":
        save_file({"model.embed_tokens.weight": weight}, str(tmp_path / "model.safetensors"))
        stream = SafetensorsWeights(str(tmp_path))
    else:
        import gguf

        writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
        writer.add_tensor("token_embd.weight", weight.numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        stream = GGUFWeights(str(tmp_path / "t.gguf"), "llama", 4, 2)
    name = "model.embed_tokens.weight"
    assert stream.rows(name) == weight.shape[0]
    sliced = Int8Table.from_rows(lambda a, b: stream.read_rows(name, torch.float32, a, b), stream.rows(name), 64)
    whole = Int8Table.quantize(weight)
    assert torch.equal(sliced.codes, whole.codes) and torch.equal(sliced.scales, whole.scales)


# ---- CUDA: the row-major table (CudaInt8Table), its Triton head or torch fallback; run by `make gpu-check` ------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (make gpu-check runs these)")


def test_cuda_takes_the_int8_table_and_its_bytes_are_the_planned_ones():
    """Without a GPU: the loader's choice on CUDA (any hidden % 32 == 0) and the table's storage, built on CPU
    tensors (the layout does not depend on the device), equal tools/plan/weights.py's CUDA formula exactly."""
    from oval_edge.runtime.model.embeddings import CudaInt8Table
    from oval_edge.tools.plan.model import ModelShape
    from oval_edge.tools.plan.weights import weight_bytes as planned

    assert int8_table_applies(4096, torch.device("cuda")) and not int8_table_applies(4100, torch.device("cuda"))
    weight = torch.randn(1000, 96)  # 1000 rows: no padding on CUDA
    table = CudaInt8Table.from_rows(lambda a, b: weight[a:b], 1000, 96, torch.device("cpu"))
    held = table.codes.untyped_storage().nbytes() + table.scales.untyped_storage().nbytes()
    shape = ModelShape("t", "-", "llama", 1, 96, 64, 2, 1, 48, 1000, 128, False, False, "test", 0)
    with_kernel = planned(shape, "nf4", "cuda", int8_head_kernel=True)
    assert held == with_kernel.embedding == with_kernel.lm_head == 1000 * 96 * 9 // 8


def test_cuda_table_head_traces_whole_under_torch_compile():
    """The row-major table's head is the torch.library op oval_edge::int8_head_rows under torch.compile (the CPU
    dispatch runs the same layout, so this needs no GPU): one graph, the eager result."""
    from oval_edge.runtime.model.embeddings import CudaInt8Table

    weight = torch.randn(100, 64, generator=torch.Generator().manual_seed(2))
    table = CudaInt8Table.from_rows(lambda a, b: weight[a:b], 100, 64, torch.device("cpu"))
    head = Int8Head(table, torch.float32)
    x = torch.randn(3, 64)
    compiled = torch.compile(head, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(x), head(x)) and head(x).shape == (3, 100)


@needs_cuda
@pytest.mark.parametrize("triton", ["1", "0"])
def test_cuda_load_holds_int8_tables_with_logits_near_the_16_bit_head(monkeypatch, triton):
    """The bundled model on CUDA in nf4: with the Triton head one row-major int8 table (tied), without it one 16-bit
    table for both (the fallback would move ~8x a 16-bit head's bytes), planner bytes within 3% of the loader's,
    logits within the quantization bound of the 16-bit head."""
    from oval_edge.runtime.model import embeddings
    from oval_edge.runtime.model.loader import load_model
    from oval_edge.tools.plan.model import read_model_shape
    from oval_edge.tools.plan.weights import weight_bytes as planned

    monkeypatch.setenv("OVAL_EDGE_TRITON", triton)
    loaded = load_model("default", "nf4", "cuda")
    embed, head = loaded.model.model.embed_tokens, loaded.model.lm_head
    plan = planned(read_model_shape("default"), "nf4", "cuda", int8_head_kernel=triton == "1").total
    assert abs(plan - loaded.weight_bytes) <= 0.03 * loaded.weight_bytes, (plan, loaded.weight_bytes)
    if triton == "0":
        assert isinstance(head, embeddings.StoredHead) and head.weight is embed.weight
        return
    assert isinstance(embed.table, embeddings.CudaInt8Table) and embed.table is head.table
    assert head.table.head_kernel is not None, "Triton head missing or failing its check"
    ids = torch.tensor([1, 500, 49151], device="cuda")
    x = embed(ids)  # [3, hidden] in the activation dtype
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (3, 49152)
    table = head.table
    dequantized = (table.codes.float().view(table.rows, -1, 32) * table.scales[..., None]).view(table.rows, -1)
    assert torch.allclose(logits, x.float() @ dequantized.T, rtol=1e-4, atol=1e-3)
    captured = torch.cuda.CUDAGraph()  # capturable: no host reads inside (a warm-up run compiles Triton first)
    head(x)
    torch.cuda.synchronize()
    with torch.cuda.graph(captured):
        replayed = head(x)
    captured.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, logits)
