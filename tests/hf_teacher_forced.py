"""Teacher-forced fidelity of OVAL against dense attention, through the Hugging Face model: a test helper
(tests/test_hf_integration.py). It lived in the package while nothing but that test called it; `oval-edge eval`
measures the runtime's own forward.

`teacher_forced_kl` prefills positions 0..start-1 densely into an OVAL page pool, then feeds the true tokens
start..T-1 one at a time through the model with OVAL attention, and compares each next-token distribution with the
dense model's at the same position. The selection and attention code is the runtime's (oval_edge.sparse.attention).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from oval_edge.config import OvalConfig

from oval_edge.hf.cache import OvalCache, build_state, is_oval_attention
from oval_edge.hf.integration import cache_keyword, register_oval_attention


@dataclass(frozen=True)
class TeacherForcedResult:
    """Over positions start..T-1 (each predicts the following token) of every row."""

    kl: float  # mean KL(dense || oval) of the next-token distributions, nats
    top1: float  # fraction of positions where argmax(oval) == argmax(dense)
    perplexity: float  # exp(mean NLL) of the true next tokens under OVAL (positions start..T-2)
    dense_perplexity: float  # the same under dense attention
    positions: int  # positions compared (rows x (T - start))
    mean_slots: float  # K/V slots read per KV head per sparse decode layer-step (0 if no layer was sparse)
    read_fraction: float  # slots read / slots dense attention would read, over all decode layer-steps

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@torch.no_grad()
def teacher_forced_kl(model, input_ids: torch.Tensor, start: int, config: OvalConfig) -> TeacherForcedResult:
    """Mean KL(dense || OVAL), top-1 agreement and perplexity over positions start..T-1 of `input_ids` [B, T].

    The model may or may not be patched with apply_oval_to_model: this uses its own pool, sized for the text,
    with `config`, and switches the model's attention to OVAL only for the duration of the call.
    """
    if model.training:
        raise ValueError("teacher_forced_kl needs model.eval() (OVAL steps aside in training mode)")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    batch, total = input_ids.shape
    if not 1 <= start < total:
        raise ValueError(f"start={start} must be in [1, {total - 1}] for a text of {total} tokens")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)

    hidden = _dense_hidden(model, input_ids)  # [B, T, H]: one dense forward, original attention
    head = model.get_output_embeddings()
    state = build_state(model, config, num_pages=batch * -(-total // config.page_size))
    sparse = [0, 0]  # valid slots of rows that selected pages, (row, KV head) pairs they cover

    def count_sparse(layer, selection, step):
        rows = selection.sparse_rows
        sparse[0] += int(selection.valid[rows].sum())
        sparse[1] += int(rows.sum()) * selection.valid.shape[1]

    state.add_selection_hook(count_sparse)
    cache = OvalCache(state)
    keyword = cache_keyword(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}
    kl_sum, agree, nll_oval, nll_dense, counted = 0.0, 0, 0.0, 0.0, 0
    previous = model.config._attn_implementation
    try:
        if not is_oval_attention(previous):
            model.set_attn_implementation(register_oval_attention(previous or "sdpa"))
        model(input_ids=input_ids[:, :start], use_cache=True, **{keyword: cache}, **extra)  # dense prefill
        for pos in range(start, total):
            out = model(input_ids=input_ids[:, pos : pos + 1], use_cache=True, **{keyword: cache}, **extra)
            oval_logp = torch.log_softmax(out.logits[:, -1].double(), dim=-1)  # [B, V]
            dense_logp = torch.log_softmax(head(hidden[:, pos]).double(), dim=-1)
            kl_sum += float((dense_logp.exp() * (dense_logp - oval_logp)).sum())
            agree += int((oval_logp.argmax(-1) == dense_logp.argmax(-1)).sum())
            if pos + 1 < total:
                target = input_ids[:, pos + 1, None]
                nll_oval -= float(oval_logp.gather(1, target).sum())
                nll_dense -= float(dense_logp.gather(1, target).sum())
                counted += batch
    finally:
        cache.release()
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
    positions = batch * (total - start)
    return TeacherForcedResult(
        kl=kl_sum / positions,
        top1=agree / positions,
        perplexity=math.exp(nll_oval / counted) if counted else float("nan"),
        dense_perplexity=math.exp(nll_dense / counted) if counted else float("nan"),
        positions=positions,
        mean_slots=sparse[0] / sparse[1] if sparse[1] else 0.0,
        read_fraction=state.stats.read_fraction,
    )


def _dense_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states of a dense forward without cache (the original attention runs: no OvalCache)."""
    decoder = model.get_decoder()
    return decoder(input_ids=input_ids, use_cache=False).last_hidden_state


def _forward_params(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)
