"""A model's own tokenizer and chat template, read without importing transformers' model classes; the chat template
an operator puts in its place (`serve --chat-template`), and whether a template renders tools."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .origin.source import ModelSource


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


# Templates shipped as package data, by the name `--chat-template` takes.
SHIPPED_TEMPLATES = {"chatml-tools": Path(__file__).parent / "templates" / "chatml-tools.jinja"}


def read_chat_template(spec: str) -> str:
    """The text of `--chat-template SPEC`: a shipped template's name or a Jinja file; raises ValueError naming it
    when it cannot be read or does not parse."""
    path = SHIPPED_TEMPLATES.get(spec, Path(os.path.expanduser(spec)))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {spec!r}: cannot read {path} ({exc}); give a Jinja file or one of the "
                         f"shipped templates: {', '.join(SHIPPED_TEMPLATES)}") from exc
    parse_template(text, f"--chat-template {spec!r}")
    return text


def parse_template(text: str, where: str):
    """The template's Jinja syntax tree (transformers renders it with the loopcontrols extension)."""
    import jinja2

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{where}: the template does not parse (line {exc.lineno}: {exc.message})") from exc


def renders_tools(tokenizer, override: str | None = None) -> bool:
    """Whether the chat template in use reads the `tools` variable (one that does not would silently drop them)."""
    template = override if override is not None else tokenizer.chat_template
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when tools are passed
        template = template.get("tool_use", template.get("default"))
    return isinstance(template, str) and _reads_tools(template)


@functools.lru_cache(maxsize=16)
def _reads_tools(template: str) -> bool:
    # Cached by the template's text: parsing one takes ~10 ms, and a server asks for every request with tools.
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(parse_template(template, "the chat template"))
    except ValueError:
        return False


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template: str | None = None) -> list[int]:
    """Token ids of `messages` under the chat template (`template`, else the tokenizer's own), with `tools`
    rendered where given, and the assistant turn opened."""
    kwargs = {"tools": tools} if tools else {}
    if template is not None:
        kwargs["chat_template"] = template
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
