"""Read a checkpoint one tensor at a time, under transformers' parameter names, in the dtype asked for.

The loader quantizes each decoder layer as soon as its tensors are read, so the process never holds the whole
model in 16 or 32 bits: a GGUF is dequantized tensor by tensor (large ones a slice of rows at a time) straight
from its memory map, safetensors shards are read through safetensors' own memory map.
"""

from __future__ import annotations

import mmap
import os
import re

import numpy as np
import torch

from .families.gemma4_gguf import GEMMA4_GGUF_ARCHS, decoder_tensors as gemma4_tensors
from .families.hybrid_gguf import HYBRID_GGUF_ARCHS, HybridLayout, hf_name as hybrid_name

# GGUF tensor names (llama.cpp's convert_hf_to_gguf) -> transformers' names for Llama-family decoders.
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # Llama 3.1 frequency factors (see config.rotary_inv_freq)
    # Phi-3 LongRoPE factors: read into the configuration (gguf_metadata.py), not by the decoder build
    "rope_factors_long.weight": "rope_factors_long", "rope_factors_short.weight": "rope_factors_short",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3's per-head norms
}
# Gemma in llama.cpp's names: four norms per layer, and ffn_norm is the one *before* the MLP (Llama's
# post_attention_layernorm); llama.cpp's converter stored each norm weight as 1 + w (NORMS_FOLDED).
_GGUF_GEMMA_LAYER = {
    **_GGUF_LAYER, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's phi3 keeps the checkpoint's fused projections: attn_qkv rows q | k | v, and ffn_up holding gate | up
# (there is no ffn_gate), which for every other architecture is the up projection alone.
_GGUF_PHI3_LAYER = {**_GGUF_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GGUF_LAYER_BY_ARCH = {"gemma2": _GGUF_GEMMA_LAYER, "gemma3": _GGUF_GEMMA_LAYER, "gemma3_text": _GGUF_GEMMA_LAYER,
                       "phi3": _GGUF_PHI3_LAYER}
_NORMS_FOLDED = ("gemma2", "gemma3", "gemma3_text")
_GGUF_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")
_CHUNK_BYTES = 4 << 20  # fp32 bytes dequantized at once: bounds the load peak whatever the tensor size


class GGUFWeights:
    """Tensors of a GGUF file. llama.cpp stores Llama's q/k rows interleaved for its rotary layout; they are put
    back in transformers' rotate_half order here, as transformers' own GGUF loader does (Qwen2 is stored as is).
    Qwen3.5 / LFM2 (architecture `qwen35`, `qwen3_5_text`, `qwen3_5` or `lfm2`) come back as transformers' state
    dict: names, shapes and values (families/hybrid_gguf.py undoes the converter's changes); so does Gemma 4's text
    decoder (`gemma4`, `gemma4_text`; families/gemma4_gguf.py: names only, its values are stored as they are)."""

    def __init__(self, path: str, architecture: str, heads: int, kv_heads: int):
        from gguf import GGUFReader

        self.path = path
        self._reader = GGUFReader(path)
        self._permute = {"self_attn.q_proj.weight": heads, "self_attn.k_proj.weight": kv_heads} \
            if architecture in ("llama", "mistral", "smollm3") else {}
        self._hybrid = None  # Qwen3.5 / LFM2: llama.cpp's changes to undo (families/hybrid_gguf.py)
        if architecture in HYBRID_GGUF_ARCHS:
            self._hybrid, self._tensors = _hybrid_tensors(self._reader, path, architecture)
        elif architecture in GEMMA4_GGUF_ARCHS:
            self._tensors = gemma4_tensors(self._reader, path, _header_scalars(self._reader))
        else:
            layer_names = _GGUF_LAYER_BY_ARCH.get(architecture, _GGUF_LAYER)
            self._tensors = {_hf_name(tensor.name, path, layer_names): tensor for tensor in self._reader.tensors}
        self.norms_folded = architecture in _NORMS_FOLDED  # see _GGUF_GEMMA_LAYER
        # The parsed header (49k vocabulary strings as numpy views: ~100 MB of Python objects) is not needed here;
        # the configuration and tokenizer are read elsewhere. The tensors keep their views into the file's map.
        self._reader.fields.clear()

    def names(self) -> list[str]:
        return list(self._tensors)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        from gguf import dequantize

        tensor = self._tensors[name]
        data = tensor.data  # [rows, bytes per row] quantized, or [rows, cols] float; a view into the file's mmap
        if data.ndim == 1:
            flat = torch.from_numpy(np.array(dequantize(data, tensor.tensor_type), dtype=np.float32))
            return (self._hybrid.restore(name, flat) if self._hybrid else flat).to(dtype)  # values in fp32
        first = dequantize(data[:1], tensor.tensor_type)  # one row tells the row width in weights
        rows, cols = data.shape[0], first.shape[-1]
        out = torch.empty((rows, cols), dtype=dtype)
        step = max(1, _CHUNK_BYTES // (4 * cols))
        for start in range(0, rows, step):
            block = dequantize(data[start : start + step], tensor.tensor_type)  # [<=step, cols] float32
            if not block.flags.writeable:  # an F32 tensor comes back as a read-only view of the file's map
                block = np.array(block, dtype=np.float32)  # one chunk (<= 4 MiB): torch refuses read-only arrays
            out[start : start + step] = torch.from_numpy(np.ascontiguousarray(block, dtype=np.float32))
        self._drop_pages(tensor.data_offset, data.nbytes)
        suffix = name.split(".", 3)[-1]
        if suffix in self._permute:
            out = _unpermute_rotary_rows(out, self._permute[suffix])
        return self._hybrid.restore(name, out) if self._hybrid else out  # 2-D: reorders and reshapes only

    def stored_type(self, name: str) -> str:
        """The GGML type name the file stores `name` in (Q4_1, Q6_K, F32, ...)."""
        return self._tensors[name].tensor_type.name

    def read_grouped(self, name: str):
        """A 2-D tensor's own blocks as grouped codes (gguf_blocks.convert: (codes, scales, mins, bits)), with
        Llama's q/k rows put back in rotate_half order like `read`; None for a type with no grouped form."""
        from .grouped.gguf_blocks import convert

        tensor = self._tensors[name]
        data = tensor.data
        if self._hybrid:  # Qwen3.5's value heads back in grouped order, moving whole rows and blocks
            data = _reordered_blocks(data, tensor.tensor_type, self._hybrid.row_order(name),
                                     self._hybrid.column_order(name))
            if data is None:
                return None
        grouped = convert(data, tensor.tensor_type.name)
        self._drop_pages(tensor.data_offset, tensor.data.nbytes)
        suffix = name.split(".", 3)[-1]
        if grouped is None or suffix not in self._permute:
            return grouped
        codes, scales, mins, bits = grouped
        order = _rotary_row_order(codes.shape[0], self._permute[suffix])
        return codes[order].contiguous(), scales[order].contiguous(), mins[order].contiguous(), bits

    def read_rows(self, name: str, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of a 2-D tensor stored unpermuted (the embedding, the head), dequantized alone: the
        int8 table is built from slices without a 16-bit copy of the whole matrix."""
        from gguf import dequantize

        tensor = self._tensors[name]
        block = dequantize(tensor.data[start:stop], tensor.tensor_type)  # [rows, cols] float32
        per_row = tensor.data.nbytes // max(1, tensor.data.shape[0])
        self._drop_pages(tensor.data_offset + start * per_row, (stop - start) * per_row)
        return torch.from_numpy(np.array(block, dtype=np.float32)).to(dtype)

    def rows(self, name: str) -> int:
        return int(self._tensors[name].data.shape[0])

    def _drop_pages(self, offset: int, length: int) -> None:
        """Let the kernel drop the file pages just read from this process's resident set (they are read again
        from the file if touched): otherwise the whole file (~100 MB here) sits on top of the loading peak."""
        handle = getattr(self._reader.data, "_mmap", None)  # numpy.memmap's mmap.mmap
        start = offset - offset % mmap.PAGESIZE
        try:
            handle.madvise(mmap.MADV_DONTNEED, start, offset + length - start)
        except (AttributeError, OSError, ValueError):  # no madvise here (non-Linux) or no map: nothing to drop
            pass

    def close(self) -> None:
        """Drop the memory map: its pages would otherwise stay in the process's resident set."""
        self._tensors.clear()
        self._reader = None


class SafetensorsWeights:
    """Tensors of a Hugging Face folder: every *.safetensors shard (or, failing those, *.bin files)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self.path = directory
        self._files = {}
        self._where: dict[str, object] = {}
        self._stored: dict[str, str] = {}  # decoder name -> the name in the file, where they differ
        shards = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        for shard in shards:
            handle = safe_open(os.path.join(directory, shard), framework="pt")
            self._files[shard] = handle
            for key in handle.keys():
                if not key.endswith("rotary_emb.inv_freq") and not key.startswith(_NOT_THE_DECODER):
                    self._where[_decoder_name(key)] = handle
                    if _decoder_name(key) != key:
                        self._stored[_decoder_name(key)] = key
        if not shards:
            for shard in sorted(f for f in os.listdir(directory) if f.endswith(".bin")):
                state = torch.load(os.path.join(directory, shard), map_location="cpu", mmap=True, weights_only=True)
                self._files[shard] = state
                for key in state:
                    if not key.endswith("rotary_emb.inv_freq"):
                        self._where[key] = state

    def names(self) -> list[str]:
        return list(self._where)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        source = self._where[name]
        name = self._stored.get(name, name)
        tensor = source[name] if isinstance(source, dict) else source.get_tensor(name)
        # Always a copy of our own: a tensor already in `dtype` would otherwise stay a view into the file's map, at
        # whatever alignment the file gives it, and a one-row GEMV's rounding depends on its weight's alignment
        # (measured on a tied head: a cached load, 64-byte aligned, differed in the last bit).
        return tensor.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)

    def read_rows(self, name: str, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of a 2-D tensor, read alone (safetensors slices the file's map)."""
        source = self._where[name]
        name = self._stored.get(name, name)
        rows = source[name][start:stop] if isinstance(source, dict) else source.get_slice(name)[start:stop]
        return rows.to(dtype).contiguous()

    def rows(self, name: str) -> int:
        source = self._where[name]
        name = self._stored.get(name, name)
        return int(source[name].shape[0] if isinstance(source, dict) else source.get_slice(name).get_shape()[0])

    def close(self) -> None:
        self._where.clear()
        self._files.clear()


# A multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration) holds the text decoder under a prefix, next to
# a vision tower that is not run.
_NOT_THE_DECODER = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_DECODER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."))


def _decoder_name(key: str) -> str:
    for prefix, plain in _DECODER_PREFIXES:
        if key.startswith(prefix):
            return plain + key[len(prefix):]
    return key


def _hf_name(gguf_name: str, path: str, layer_names: dict) -> str:
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    match = _GGUF_LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in layer_names:
        raise ValueError(f"model {path}: tensor {gguf_name!r} is not part of a supported decoder; oval-edge runs "
                         "Llama, SmolLM2, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, Gemma 3, Gemma 4, Qwen3.5 and LFM2 "
                         "GGUF files")
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"


def _hybrid_tensors(reader, path: str, architecture: str) -> tuple[HybridLayout, dict]:
    """(the inverse transforms, {transformers name: tensor}) of a qwen35 / lfm2 GGUF. A Qwen3.5 file may hold
    multi-token-prediction blocks after the decoder's (`nextn_predict_layers`): they are not run, so not listed."""
    scalar = _header_scalars(reader)
    layers = int(scalar("block_count") or 0) - int(scalar("nextn_predict_layers") or 0)
    tensors = {}
    for tensor in reader.tensors:
        block = _GGUF_BLOCK.match(tensor.name)
        if block and int(block.group(1)) >= layers:
            continue
        name = hybrid_name(tensor.name, architecture)
        if name is None:
            raise ValueError(f"model {path}: tensor {tensor.name!r} is not part of a {architecture} text decoder as "
                             "llama.cpp's converter writes it")
        tensors[name] = tensor
    return HybridLayout.from_header(architecture, scalar), tensors


def _header_scalars(reader):
    """scalar(key) -> the header value of `<general.architecture>.<key>` (None when absent)."""
    from .gguf_metadata import header_scalar

    arch = header_scalar(reader.fields, "general.architecture")
    return lambda key: header_scalar(reader.fields, f"{arch}.{key}")


def _reordered_blocks(data: np.ndarray, kind, rows: torch.Tensor | None, columns: torch.Tensor | None):
    """A 2-D tensor's raw rows [rows, bytes per row] with rows and columns put in `rows` / `columns` order (None: as
    stored), moving whole quantized blocks; None when a column run is not whole blocks (the caller re-quantizes
    the dequantized, reordered weights instead)."""
    from gguf.constants import GGML_QUANT_SIZES

    if data.dtype != np.uint8:  # a float tensor: no grouped form whatever its order
        return None
    if rows is not None:
        data = data[rows.numpy()]
    if columns is None:
        return data
    block, size = GGML_QUANT_SIZES[kind]
    starts = columns.reshape(-1, block)  # a block of transformers' columns must be one stored block, in order
    if columns.numel() % block or not torch.equal(starts, starts[:, :1] + torch.arange(block)) \
            or bool((starts[:, 0] % block).any()):
        return None
    order = (starts[:, 0] // block).numpy()
    return data.reshape(data.shape[0], -1, size)[:, order].reshape(data.shape[0], -1)


def _unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads * D, in] with each head's rows ordered (pairs interleaved) -> halves order: row 2i+j -> j*D/2 + i."""
    return weight[_rotary_row_order(weight.shape[0], heads)].contiguous()


def _rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """Stored row of each output row when a head's interleaved pairs (row 2i+j) go to halves order (j*D/2 + i)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
