"""A model's own tokenizer and chat template, read without importing transformers' model classes."""

from __future__ import annotations

import os

from .source import ModelSource


def load_tokenizer(source: ModelSource, metadata: str | None = None):
    """The model's own tokenizer and chat template, as a tokenizers-backed transformers tokenizer.

    metadata: the GGUF's converted tokenizer folder (runtime/model/gguf_metadata.py), read instead of the GGUF.

    AutoTokenizer would import the model's transformers config class (and with it ~80 MB of sympy and
    torch.distributed); the fast tokenizer class reads tokenizer.json or the GGUF vocabulary directly. A folder
    with only a slow (sentencepiece) tokenizer still loads, through AutoTokenizer.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        if metadata is not None:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(metadata)
        elif source.gguf_file or os.path.isfile(os.path.join(source.directory, "tokenizer.json")):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(source.directory, **kwargs)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source.directory)
    except Exception as exc:
        raise ValueError(f"model {source.path}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(tokenizer, model) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS and the model's generation_config eos_token_id(s)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids
