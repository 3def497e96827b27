"""The peers in a bench worker: Hugging Face `generate()` and llama.cpp (llama-cpp-python), same GGUF, same ids.

Hugging Face: transformers loads the GGUF by dequantizing it (to fp32 by default: its CPU path has no 4-bit
GGUF kernels), decodes densely with its DynamicCache in that dtype, greedy, `min_new_tokens` = `max_new_tokens`
so it never stops early. A streamer timestamps each token as generate() hands it out.

llama.cpp: `Llama(model_path=<the GGUF>, n_ctx=prompt+gen, n_threads=n_threads_batch=<threads>)`, its default f16
K/V cache, greedy (temp 0, top_k 1). Timed through `Llama.generate()` — the loop llama-cpp-python's own
`create_completion` runs: `eval(prompt)` (batched prefill, n_batch 512), then sample / `eval([token])` per token —
without create_completion's detokenizing and stop-string scanning, which would add Python work that the other
engines do not do in this bench. The cache is reset before the timed run so no warm-up K/V is reused.

Neither peer reports what it reads per step; their KV bytes per step are computed: tokens in the cache at the
last decode step (prompt + generated - 1) x K and V bytes per token of their cache dtype, all layers. Both attend
densely, so they read no page summaries (summary bytes 0).
"""

from __future__ import annotations

import os

from .meters import MemoryMeter, TokenClock
from .settings import WARMUP_GEN_TOKENS

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
LLAMA_CPP_KV_DTYPE = "float16"  # llama.cpp's default type_k / type_v (f16)


def computed_kv_bytes(job: dict, dtype: str) -> int:
    """K+V bytes a dense step reads at the last decode step, all layers (job['kv_elements_per_token']:
    command.dense_kv_elements of the model's shape): every cached token in the layers reading the whole context,
    the window's tokens in the sliding ones."""
    tokens = len(job["prompt_ids"]) + int(job["gen"]) - 1
    per = job["kv_elements_per_token"]
    window = min(tokens, int(per["sliding_window"] or tokens))
    return (tokens * int(per["full"]) + window * int(per["window"])) * DTYPE_BYTES[dtype]


def _kv_source(dtype: str) -> str:
    return f"computed: the K/V a dense step reads in {dtype}, all layers (sliding layers: their window)"


def run_hf(job: dict, meter: MemoryMeter, clock: TokenClock) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(int(job["threads"]))
    kwargs = {"gguf_file": job["gguf_file"]} if job["gguf_file"] else {}
    dtype = job["hf_dtype"]
    device = torch.device(job["device"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=getattr(torch, dtype), **kwargs)
    model = model.eval().requires_grad_(False).to(device)
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, (list, tuple)) else eos

    class Stamps(BaseStreamer):
        """generate() calls put() once with the prompt, then once per new token; end() when it is done."""

        def __init__(self, on_token) -> None:
            self.on_token, self.seen_prompt = on_token, False

        def put(self, value) -> None:
            if not self.seen_prompt:
                self.seen_prompt = True
                return
            for token in value.reshape(-1).tolist():  # .tolist() waits for the device, so the stamp is honest
                self.on_token(token)

        def end(self) -> None:
            pass

    def generate(ids: list[int], new_tokens: int, on_token) -> None:
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=pad, streamer=Stamps(on_token), use_cache=True,
            )

    generate(list(job["warmup_ids"]), WARMUP_GEN_TOKENS, lambda _t: None)
    meter.after_load()
    clock.begin()
    generate(list(job["prompt_ids"]), int(job["gen"]), clock.tick)
    seen, weights = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:  # tied embedding / head counted once
            seen.add(tensor.data_ptr())
            weights += tensor.numel() * tensor.element_size()
    return {
        "label": f"hf generate ({dtype} weights, dense, {model.config._attn_implementation})",
        "kv_bytes_per_step": computed_kv_bytes(job, dtype),
        "summary_bytes_per_step": 0,  # dense: every cached K/V is read, no page is scored
        "kv_bytes_source": _kv_source(dtype),
        "kv_dtype": dtype,
        "weight_bytes": weights,
    }


def run_llamacpp(job: dict, meter: MemoryMeter, clock: TokenClock) -> dict:
    import llama_cpp  # and nothing of oval_edge.runtime: this process must not hold torch

    if not job["gguf_file"]:
        raise ValueError(f"llama.cpp needs a GGUF file; {job['model_dir']} is a Hugging Face folder")
    path = os.path.join(job["model_dir"], job["gguf_file"])
    threads = int(job["threads"])
    prompt, gen = list(job["prompt_ids"]), int(job["gen"])
    offload = job["device"] == "cuda" and bool(llama_cpp.llama_supports_gpu_offload())
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=max(len(prompt) + gen, len(job["warmup_ids"]) + WARMUP_GEN_TOKENS),
        n_threads=threads, n_threads_batch=threads, n_gpu_layers=-1 if offload else 0, seed=0, verbose=False,
    )
    greedy = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}

    def generate(ids: list[int], new_tokens: int, on_token) -> None:
        llm.reset()  # n_tokens = 0: no prefix of an earlier request is reused, the whole prompt is evaluated
        for count, token in enumerate(llm.generate(ids, **greedy), start=1):
            on_token(token)
            if count >= new_tokens:
                break  # ignore EOS like the other engines: stop on the count alone

    generate(list(job["warmup_ids"]), WARMUP_GEN_TOKENS, lambda _t: None)
    meter.after_load()
    clock.begin()
    generate(prompt, gen, clock.tick)
    try:
        weights = int(llama_cpp.llama_model_size(llm.model))
    except (AttributeError, TypeError):  # older bindings: the file is the weights
        weights = os.path.getsize(path)
    return {
        "label": f"llama.cpp ({job['gguf_file']}, f16 KV{', GPU offload' if offload else ''})",
        "kv_bytes_per_step": computed_kv_bytes(job, LLAMA_CPP_KV_DTYPE),
        "summary_bytes_per_step": 0,  # dense: every cached K/V is read, no page is scored
        "kv_bytes_source": _kv_source(LLAMA_CPP_KV_DTYPE),
        "kv_dtype": LLAMA_CPP_KV_DTYPE,
        "weight_bytes": weights,
        "n_ctx": llm.n_ctx(),
        "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
        "peak_device_mb": None,
    }
