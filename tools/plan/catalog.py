"""The models plan knows by name: the ones Jetson users ask for most, so that `plan --model Qwen3-8B` works before
anything is downloaded and a module that cannot hold a model can say which known model it does hold.

Each entry keeps the fields of the published Hugging Face `config.json` that plan reads (model.shape_from_config);
nothing else of the file matters to the plan. Where each was read is in docs/plan.md ("Known models") and, for the
ones with a full copy under tests/fixtures/configs/, in its README; tests/test_plan_answer.py checks every entry
with such a copy against it, and SmolLM2-135M against the bundled GGUF's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelShape, shape_from_config

_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 131072,
           "num_key_value_heads": 8, "attention_bias": False}
_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "max_position_embeddings": 40960, "head_dim": 128,
          "num_key_value_heads": 8, "attention_bias": False, "sliding_window": None}
# Qwen3.5's text decoders (text_config of a Qwen3_5ForConditionalGeneration config): 3 Gated DeltaNet layers to 1
# gated attention layer, DeltaNet key heads of 128 (value heads differ by size), attention heads of 256
_QWEN3_5 = {"model_type": "qwen3_5_text", "head_dim": 256, "vocab_size": 248320, "max_position_embeddings": 262144,
            "tie_word_embeddings": True, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}


@dataclass(frozen=True)
class KnownModel:
    repo: str  # the Hugging Face repository, org/name
    config: dict  # the planner's fields of its config.json

    @property
    def name(self) -> str:
        return self.repo.rpartition("/")[2]

    def shape(self) -> ModelShape:
        return shape_from_config(self.config, f"{self.repo} (known model)", self.name)


KNOWN_MODELS = (
    KnownModel("HuggingFaceTB/SmolLM2-135M-Instruct", {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True}),
    KnownModel("meta-llama/Llama-3.2-1B-Instruct", _LLAMA3 | {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "head_dim": 64, "tie_word_embeddings": True}),
    KnownModel("meta-llama/Llama-3.2-3B-Instruct", _LLAMA3 | {
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "head_dim": 128, "tie_word_embeddings": True}),
    KnownModel("Qwen/Qwen3-4B", _QWEN3 | {
        "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
        "tie_word_embeddings": True}),
    KnownModel("microsoft/Phi-4-mini-instruct", {
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064, "max_position_embeddings": 131072,
        "sliding_window": 262144, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
        "attention_bias": False}),
    # the text decoder of a Gemma3ForConditionalGeneration config: its text_config, transformers' defaults filled
    KnownModel("google/gemma-3-4b-it", {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "sliding_window": 1024}),
    # the text decoder of a Qwen3_5ForConditionalGeneration config (18 Gated DeltaNet + 6 gated attention layers)
    KnownModel("Qwen/Qwen3.5-0.8B", _QWEN3_5 | {
        "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 2, "linear_num_value_heads": 16}),
    # LFM2's original keys: block_ff_dim is transformers' intermediate_size (the MLP holds 2/3 of it, rounded up to
    # 256: 8192); full_attn_idxs lists the 6 attention layers, the other 10 are short convs of conv_L_cache taps
    KnownModel("LiquidAI/LFM2-1.2B", {
        "model_type": "lfm2", "hidden_size": 2048, "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True,
        "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536, "max_position_embeddings": 128000,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3, "rope_theta": 1000000.0}),
    KnownModel("Qwen/Qwen3.5-2B", _QWEN3_5 | {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 2, "linear_num_value_heads": 16}),
    KnownModel("Qwen/Qwen3.5-4B", _QWEN3_5 | {
        "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "linear_num_value_heads": 32}),
    # the text decoder of a Gemma4ForConditionalGeneration config: 35 layers, every 5th full (head dim 512, pages),
    # the rest sliding on 512 tokens (head dim 256, rings); the last 20 read the K/V of layers 13 and 14 and keep
    # none; per-layer inputs of 256 per layer from a [262144, 35 x 256] table (its largest tensor)
    KnownModel("google/gemma-4-E2B-it", {
        "model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
        "vocab_size": 262144, "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
        "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "sliding_window": 512,
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)]}),
    KnownModel("meta-llama/Llama-3.1-8B-Instruct", _LLAMA3 | {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "tie_word_embeddings": False}),
    KnownModel("Qwen/Qwen3-8B", _QWEN3 | {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "tie_word_embeddings": False}),
)


def known_model(name: str) -> KnownModel | None:
    """The entry named `name`: its repository (org/name) or its name alone, any case; None when plan knows none."""
    wanted = name.strip().lower()
    return next((m for m in KNOWN_MODELS if wanted in (m.repo.lower(), m.name.lower())), None)


def known_names() -> list[str]:
    return [m.name for m in KNOWN_MODELS]
