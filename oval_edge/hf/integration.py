"""OVAL inside Hugging Face `generate()`: `apply_oval_to_model(model, config)` and `remove_oval(model)`
([R-interfaces]).

How it plugs in (transformers 5.x, Llama-family models):
- an attention function and its mask function are registered with `AttentionInterface` / `AttentionMaskInterface`
  under 'oval' (or 'oval_<original>' when the model did not use sdpa) and the model is switched to that name;
- `model.generate` is wrapped so that, unless the caller passes a cache, it runs on an `OvalCache` whose K/V live in
  one `PagePool` allocated here, once.
The attention function runs the core library's `prefill_attention` (several new tokens: dense, causal) and
`decode_attention` (one new token: OVAL page selection; the first `dense_layers` layers dense) on that pool. Without
an `OvalCache` (a plain `model(...)` call, a DynamicCache), in `model.train()` mode or under gradient checkpointing
(which drops the cache) it steps aside and the model's original attention runs on exactly what it would have seen.
"""

from __future__ import annotations

import inspect
import sys
import weakref

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from oval_edge.config import OvalConfig
from oval_edge.sparse.attention import decode_attention, gather_kv
from oval_edge.sparse.prefill import prefill_attention

from .cache import (
    OVAL_ATTENTION_PREFIX,
    OVAL_CALL_ATTR,
    OvalCache,
    OvalCall,
    OvalState,
    build_state,
    is_oval_attention,
    shortfall_message,
)

STATE_ATTR = "_oval_state"
_SAVED_ATTR = "_oval_saved"  # (original attention name, generate from the instance dict or None)
FALLBACKS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")


def oval_attention_name(original: str) -> str:
    return OVAL_ATTENTION_PREFIX if original == "sdpa" else f"{OVAL_ATTENTION_PREFIX}_{original}"


def register_oval_attention(original: str) -> str:
    """Register the OVAL attention + mask functions that fall back to `original`; returns the name to set."""
    if original not in FALLBACKS:
        raise ValueError(f"attention implementation {original!r} is not supported under OVAL; use one of {FALLBACKS}")
    name = oval_attention_name(original)
    AttentionInterface.register(name, _make_attention(original))
    # Masks are those of the original implementation: its fallback needs them, the OVAL path reads only padding.
    AttentionMaskInterface.register(name, _make_mask(original))
    return name


def _make_mask(original: str):
    def oval_mask(*args, **kwargs):
        return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, **kwargs)

    return oval_mask


def _original_attention(original: str, module):
    if original == "eager":  # 'eager' is each modeling file's own function, not a registered one
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward to fall back to")
        return eager
    return ALL_ATTENTION_FUNCTIONS[original]


def _make_attention(original: str):
    def oval_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query [B, Hq, n, D]; key, value [B, Hkv, n', D] -> ([B, n, Hq, D], None)."""
        call: OvalCall | None = getattr(key, OVAL_CALL_ATTR, None)
        fallback = _original_attention(original, module)
        if call is None:  # no OvalCache: plain forward, DynamicCache, gradient checkpointing
            return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if module.training:  # pitfall 3: OVAL steps aside; the original attention sees the full history
            key, value = _dense_history(call, key, value)
            return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return _oval_forward(call, query, key, value, attention_mask, scale, kwargs.get("position_ids")), None

    return oval_attention_forward


def _dense_history(call: OvalCall, key: torch.Tensor, value: torch.Tensor):
    """Earlier positions from the pool + this step's own k/v (keeps their autograd graph): [B, Hkv, L, D]."""
    step, pool = call.step, call.state.pool
    b, heads, new, _ = key.shape
    past = step.lengths_list[0] - new
    if past == 0:
        return key, value
    positions = torch.arange(past, device=key.device).expand(b, heads, past)
    old_k, old_v = gather_kv(pool, call.layer, step.page_table, positions)
    return torch.cat([old_k.to(key.dtype), key], dim=2), torch.cat([old_v.to(value.dtype), value], dim=2)


def _oval_forward(call: OvalCall, query, key, value, mask, scale: float, position_ids) -> torch.Tensor:
    state, step, layer = call.state, call.step, call.layer
    b, q_heads, new, dim = query.shape
    if layer == 0:  # the checks hold for every layer of the step
        _check_positions(position_ids, step, b, new)
        _check_unpadded(mask, step, b, new)
    if new == 1:
        out, selection = decode_attention(
            state.pool, layer, step, query[:, :, 0], state.config, scale, dense=layer < state.config.dense_layers
        )
        state.record_decode(layer, selection, step)
        return out[:, None].to(query.dtype)  # [B, 1, Hq, D]
    if layer == 0:
        state.stats.prefill_tokens += b * new
    q = query.transpose(1, 2).reshape(b * new, q_heads, dim)
    k = key.transpose(1, 2).reshape(b * new, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(b * new, value.shape[1], dim)
    return prefill_attention(state.pool, layer, step, q, k, v, scale).view(b, new, q_heads, dim)


def _check_positions(position_ids, step, batch: int, new: int) -> None:
    """Pitfall 1: RoPE positions must be the pool's absolute positions, also when continuing from a cache."""
    if position_ids is None:
        return
    expected = step.positions.view(batch, new)
    given = position_ids.to(expected.device).expand(batch, -1)
    if given.shape != expected.shape or not torch.equal(given, expected):
        raise ValueError(
            f"position_ids {given[0].tolist()[:4]}... do not continue the OvalCache, which holds "
            f"{int(step.lengths_list[0]) - new} tokens per row (expected {expected[0].tolist()[:4]}...). When you "
            "continue from a cache, pass the full sequence (earlier tokens + new ones) to generate(), as with any "
            "transformers cache"
        )


def _check_unpadded(mask, step, batch: int, new: int) -> None:
    """Padded rows would put pad tokens into pages and selection; refuse them (handled rows must be unpadded)."""
    if not isinstance(mask, torch.Tensor):
        return  # None (no padding), or a flex BlockMask: generate() checks the 2-D mask before it gets here
    allowed = mask if mask.dtype == torch.bool else (mask == 0) if mask.is_floating_point() else mask.bool()
    if allowed.dim() == 4:  # [B, 1, n, L]: must be exactly causal over the absolute positions
        length = allowed.shape[-1]
        query_pos = step.positions.view(batch, new).to(allowed.device)
        expected = torch.arange(length, device=allowed.device)[None, None, :] <= query_pos[:, :, None]
        padded = not torch.equal(allowed[:, 0].expand(batch, new, length), expected)
    else:
        padded = not bool(allowed.all())
    if padded:
        raise ValueError(
            "OVAL attention got a padded batch (the attention mask hides some positions). OVAL pages hold every "
            "token of a row, so rows must be unpadded: generate prompts of equal length together, or one at a time"
        )


def oval_state(model) -> OvalState | None:
    """The OvalState (pool, config, stats, hooks) of a patched model, or None."""
    return model.__dict__.get(STATE_ATTR)


def oval_active(model) -> bool:
    """OVAL decodes only in eval mode, without gradient checkpointing, while its attention is set."""
    if model.training or any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return False
    return is_oval_attention(model.config._attn_implementation)


def cache_keyword(model) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x; use whichever this model's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def apply_oval_to_model(model, config: OvalConfig | None = None, *, num_pages: int | None = None) -> OvalState:
    """Make `model.generate()` decode with OVAL. Returns the OvalState (pool, stats, selection hooks).

    The page pool is allocated here, once: `num_pages` pages if given, else from `config.memory_budget` minus the
    weights, else one sequence at the model's full context. Batch rows share it (one pool sequence per row).
    """
    config = config if config is not None else OvalConfig()
    if not isinstance(config, OvalConfig):
        raise ValueError(f"config={config!r} must be an OvalConfig")
    if oval_state(model) is not None:
        raise ValueError("OVAL is already applied to this model; call remove_oval(model) first to change its config")
    _check_supported(model)
    original = model.config._attn_implementation or "sdpa"
    name = register_oval_attention(original)
    state = build_state(model, config, num_pages)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(f"{type(model).__name__} did not accept the attention implementation {name!r}")
    saved_generate = model.__dict__.get("generate")
    model.__dict__[STATE_ATTR] = state
    model.__dict__[_SAVED_ATTR] = (original, saved_generate)
    model.__dict__["generate"] = _wrap_generate(model, model.generate)
    return state


def remove_oval(model) -> None:
    """Restore the original attention implementation and generate(); the pool is released with its state."""
    saved = model.__dict__.pop(_SAVED_ATTR, None)
    if saved is None:
        raise ValueError("OVAL is not applied to this model (apply_oval_to_model was not called, or it was removed)")
    original, saved_generate = saved
    model.__dict__.pop(STATE_ATTR, None)
    if saved_generate is None:
        model.__dict__.pop("generate", None)
    else:
        model.__dict__["generate"] = saved_generate
    model.set_attn_implementation(original)


def _check_supported(model) -> None:
    cfg = model.config
    problems = []
    if getattr(cfg, "is_encoder_decoder", False):
        problems.append("it is an encoder-decoder model")
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        problems.append(f"its layer types are {sorted(set(cfg.layer_types))} (OVAL needs full attention everywhere)")
    elif getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        problems.append(f"it uses sliding-window attention (sliding_window={cfg.sliding_window})")
    if not all(hasattr(cfg, a) for a in ("num_hidden_layers", "num_attention_heads", "hidden_size")):
        problems.append("its config lacks num_hidden_layers / num_attention_heads / hidden_size")
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        problems.append("its attention does not dispatch through transformers' AttentionInterface")
    if problems:
        raise ValueError(
            f"apply_oval_to_model supports Llama-family decoder-only models; {type(model).__name__} "
            f"(model_type={getattr(cfg, 'model_type', '?')!r}) is not one: " + "; ".join(problems)
        )


def _wrap_generate(model, original_generate):
    model_ref = weakref.ref(model)  # the wrapper lives in the model's __dict__: no reference cycle through it
    keyword = cache_keyword(model)

    def generate(*args, **kwargs):
        model = model_ref()
        state = oval_state(model)
        if state is None or not oval_active(model):
            return original_generate(*args, **kwargs)
        given = kwargs.get(keyword, kwargs.get("past_key_values"))
        if kwargs.get("use_cache") is False or (given is not None and not isinstance(given, OvalCache)):
            return original_generate(*args, **kwargs)  # no cache, or the caller's own: the original attention runs
        _check_generate_arguments(model, kwargs)
        if given is not None:  # continuing from an OvalCache: its positions carry on (pitfall 1)
            return original_generate(*args, **kwargs)
        _admit(state, model, args, kwargs)
        kwargs.pop(keyword, None)  # an explicit cache=None
        kwargs.pop("past_key_values", None)
        cache = OvalCache(state)
        try:
            out = original_generate(*args, **{keyword: cache}, **kwargs)
        except BaseException:
            cache.release()
            raise
        if getattr(out, "cache", None) is not cache and getattr(out, "past_key_values", None) is not cache:
            cache.release()  # not handed back: its pages return to the pool now
        return out

    generate.__doc__ = original_generate.__doc__
    generate.__wrapped__ = original_generate
    return generate


def _check_generate_arguments(model, kwargs) -> None:
    config = kwargs.get("generation_config") or model.generation_config
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    if beams > 1:
        raise ValueError(f"num_beams={beams}: OVAL generate() supports greedy and sampling decoding (num_beams=1)")
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError("OVAL generate() does not support assisted / prompt-lookup decoding (it crops the cache)")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all()):
        raise ValueError(
            "OVAL generate() got a padded batch (attention_mask has zeros). Rows must be unpadded: generate "
            "prompts of equal length together, or one prompt at a time"
        )


def _admit(state: OvalState, model, args, kwargs) -> None:
    """Admission by pages ([R-pool]): refuse before the prefill when prompt + max_new_tokens cannot fit."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or new is None:
        return  # unknown lengths: the cache refuses with the same message when a step does not fit
    rows = ids.shape[0] * (kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1)
    tokens = ids.shape[1] + new - 1  # the last generated token is never written to the cache
    if rows * state.pool.pages_needed(tokens) > state.pool.num_free:
        raise ValueError(shortfall_message(state.pool, rows, tokens))
