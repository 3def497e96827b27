"""The state mixers' math (runtime/engine/forward/state_mixers.py) against transformers' own functions, fp32 to
1e-5: the causal conv over a prompt in chunks and step by step, the gated delta rule chunked and recurrent, the gated
RMSNorm; batched steps with repeated (padding) slots; the two decode steps traced whole and free of host reads
([R-static-step]).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.lfm2 import configuration_lfm2 as lfm2_config
from transformers.models.lfm2 import modeling_lfm2 as lfm2
from transformers.models.qwen3_5 import configuration_qwen3_5 as qwen_config
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from oval_edge.runtime.engine.forward.op_trace import OpTrace
from oval_edge.runtime.engine.forward.state_mixers import (causal_conv, causal_conv_step, gated_delta_prefill,
                                                          gated_delta_step, gated_rms_norm)

TOL = dict(atol=1e-5, rtol=1e-5)
SPLITS = (5, 64, 70, 1)  # shorter than a chunk, exactly one, one and a bit, a single token


def conv_inputs(tokens: int, channels: int, taps: int, with_bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    return x, weight, bias


def delta_inputs(tokens: int, key_heads: int, value_heads: int, key_dim: int = 16, value_dim: int = 8, seed: int = 0):
    """q, k, v, g, beta as a Gated DeltaNet layer makes them (g = -exp(A) softplus(a), beta = sigmoid(b)), plus a
    non-zero starting state [Hv, dk, dv] (a sequence continuing after a cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, key_heads, key_dim, generator=gen)
    k = torch.randn(tokens, key_heads, key_dim, generator=gen)
    v = torch.randn(tokens, value_heads, value_dim, generator=gen)
    g = -torch.rand(value_heads, generator=gen).mul(4).exp() * torch.nn.functional.softplus(
        torch.randn(tokens, value_heads, generator=gen) - 2)
    beta = torch.randn(tokens, value_heads, generator=gen).sigmoid()
    state = torch.randn(value_heads, key_dim, value_dim, generator=gen) * 0.3
    return q, k, v, g, beta, state


def reference_delta(rule, q, k, v, g, beta, state):
    """transformers' chunked or recurrent rule on one sequence -> (out [n, Hv, dv], final state [Hv, dk, dv])."""
    out, final = rule(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None].clone(),
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


# ---- causal conv ---------------------------------------------------------------------------------------------------

# Qwen3.5's conv: K = 4, no bias, silu after; LFM2's short conv: K = 3 (conv_L_cache), a bias, no activation. Each is
# checked against its own modeling module's functions.
CONVS = [(qwen, 4, False, True), (lfm2, 3, True, False)]
CONV_IDS = ["qwen3.5", "lfm2"]


@pytest.mark.parametrize("module, taps, with_bias, silu", CONVS, ids=CONV_IDS)
def test_conv_over_a_prompt_in_chunks_equals_one_pass_and_transformers(module, taps, with_bias, silu):
    sizes = (1, 1, *SPLITS)  # two single tokens first: chunks shorter than the K-1 history
    x, weight, bias = conv_inputs(sum(sizes), 12, taps, with_bias)
    want = module.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu" if silu else None)[0].t()

    whole_state = torch.zeros(12, taps - 1)
    torch.testing.assert_close(causal_conv(x, whole_state, weight, bias, silu=silu), want, **TOL)
    torch.testing.assert_close(whole_state, x[-(taps - 1):].t(), atol=0, rtol=0)  # the last K-1 inputs, exactly

    state, pieces, start = torch.zeros(12, taps - 1), [], 0
    for size in sizes:
        pieces.append(causal_conv(x[start:start + size], state, weight, bias, silu=silu))
        start += size
        seen = torch.cat([torch.zeros(taps - 1, 12), x[:start]])  # a fresh sequence's history is zeros
        torch.testing.assert_close(state, seen[-(taps - 1):].t(), atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(pieces), want, **TOL)
    torch.testing.assert_close(state, whole_state, atol=0, rtol=0)


@pytest.mark.parametrize("module, taps, with_bias, silu", CONVS, ids=CONV_IDS)
def test_conv_step_over_steps_equals_transformers_update(module, taps, with_bias, silu):
    """Three sequences in pool rows 2, 0 and 3 of 4, a prompt each, then 12 steps; transformers' cache keeps a
    [B, C, K] state (one column more than ours), which its update reads the same way."""
    prompt, steps, channels = 6, 12, 10
    x, weight, bias = conv_inputs(3 * (prompt + steps), channels, taps, with_bias)
    x = x.view(3, prompt + steps, channels)
    slots = torch.tensor([2, 0, 3])
    states = torch.zeros(4, channels, taps - 1)
    theirs = torch.zeros(3, channels, taps)
    activation = "silu" if silu else None
    for row in range(3):
        causal_conv(x[row, :prompt], states[int(slots[row])], weight, bias, silu=silu)  # a view: written in place
        module.causal_conv1d_update(x[row, :prompt].t()[None], theirs[row:row + 1], weight, bias, activation)
    for t in range(prompt, prompt + steps):
        got = causal_conv_step(x[:, t], states, slots, weight, bias, silu=silu)
        want = module.causal_conv1d_update(x[:, t, :, None], theirs, weight, bias, activation)[..., 0]
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(states[slots], theirs[..., 1:], atol=0, rtol=0)
    assert not states[1].any()  # a row no sequence owns is never written


def test_lfm2_short_conv_layer_from_these_pieces():
    """The whole gated short conv (in_proj -> B*x -> conv -> C*. -> out_proj) over a prompt in two chunks equals
    Lfm2ShortConv's forward: the conv weight [C, 1, K] is used as [C, K]."""
    torch.manual_seed(9)
    config = lfm2_config.Lfm2Config(hidden_size=32, num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                    conv_bias=True, conv_L_cache=3, num_attention_heads=2, num_key_value_heads=1,
                                    intermediate_size=64, vocab_size=100)
    layer = lfm2.Lfm2ShortConv(config, 0).eval()
    hidden = torch.randn(1, 23, 32)
    with torch.no_grad():
        want = layer(hidden)[0]
        gate_in, gate_out, x = layer.in_proj(hidden[0]).chunk(3, dim=-1)  # [n, C] each
        state = torch.zeros(32, 2)
        gated = gate_in * x
        mixed = torch.cat([causal_conv(part, state, layer.conv.weight[:, 0], layer.conv.bias)
                           for part in (gated[:9], gated[9:])])
        got = layer.out_proj(gate_out * mixed)
    torch.testing.assert_close(got, want, **TOL)


# ---- the gated delta rule ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key_heads, value_heads", [(2, 2), (2, 4)], ids=["Hv=Hk", "Hv=2Hk"])
def test_delta_prefill_in_chunks_equals_one_call_and_both_transformers_rules(key_heads, value_heads):
    q, k, v, g, beta, start = delta_inputs(sum(SPLITS), key_heads, value_heads)
    want, want_state = reference_delta(qwen.torch_recurrent_gated_delta_rule, q, k, v, g, beta, start)
    chunked, chunked_state = reference_delta(qwen.torch_chunk_gated_delta_rule, q, k, v, g, beta, start)
    torch.testing.assert_close(chunked, want, **TOL)  # the two references agree with each other first
    torch.testing.assert_close(chunked_state, want_state, **TOL)

    state = start.clone()
    whole = gated_delta_prefill(q, k, v, g, beta, state)
    torch.testing.assert_close(whole, want, **TOL)
    torch.testing.assert_close(state, want_state, **TOL)

    state, pieces, begin = start.clone(), [], 0
    for size in SPLITS:
        end = begin + size
        pieces.append(gated_delta_prefill(q[begin:end], k[begin:end], v[begin:end], g[begin:end], beta[begin:end],
                                          state, chunk=16))
        begin = end
    torch.testing.assert_close(torch.cat(pieces), want, **TOL)
    torch.testing.assert_close(state, want_state, **TOL)


def test_delta_step_continues_a_prefill_as_transformers_recurrent_rule():
    """A prompt of 37 tokens prefilled into pool row 1 of 3, then 20 decode steps through that row."""
    q, k, v, g, beta, start = delta_inputs(57, 2, 4)
    want, want_state = reference_delta(qwen.torch_recurrent_gated_delta_rule, q, k, v, g, beta, start)
    states = torch.zeros(3, 4, 16, 8)
    states[1] = start
    got = [gated_delta_prefill(q[:37], k[:37], v[:37], g[:37], beta[:37], states[1])]
    slot = torch.tensor([1])
    for t in range(37, 57):
        got.append(gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], states, slot))
    torch.testing.assert_close(torch.cat(got), want, **TOL)
    torch.testing.assert_close(states[1], want_state, **TOL)
    assert not states[0].any() and not states[2].any()


def test_gated_deltanet_layer_from_these_pieces_prefill_then_decode():
    """Qwen3.5's whole linear-attention layer (projections, conv, gated delta rule, gated norm, out_proj) over 20
    tokens: a prompt of 15 in two chunks, then 5 decode steps through pool row 1, equals Qwen3_5GatedDeltaNet's
    forward over all 20 at once (causal, so each token's output is the same)."""
    torch.manual_seed(10)
    config = qwen_config.Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=16, intermediate_size=64, vocab_size=100)
    layer = qwen.Qwen3_5GatedDeltaNet(config, 0).eval()
    hidden = torch.randn(20, 32)
    conv_states, delta_states, slot = torch.zeros(2, 64, 3), torch.zeros(2, 4, 8, 8), torch.tensor([1])

    def mix(h, conv, delta):
        n = h.shape[0]
        mixed = conv(layer.in_proj_qkv(h), layer.conv1d.weight[:, 0])  # [n, 2*Hk*dk + Hv*dv]
        q, k, v = mixed.split([16, 16, 32], dim=-1)
        g = -layer.A_log.exp() * torch.nn.functional.softplus(layer.in_proj_a(h) + layer.dt_bias)
        core = delta(q.view(n, 2, 8), k.view(n, 2, 8), v.view(n, 4, 8), g, layer.in_proj_b(h).sigmoid())
        gated = gated_rms_norm(core, layer.in_proj_z(h).view(n, 4, 8), layer.norm.weight, config.rms_norm_eps)
        return layer.out_proj(gated.reshape(n, 32))

    with torch.no_grad():
        want = layer(hidden[None])[0]
        got = [mix(hidden[start:end], lambda x, w: causal_conv(x, conv_states[1], w, silu=True),
                   lambda *a: gated_delta_prefill(*a, delta_states[1])) for start, end in ((0, 9), (9, 15))]
        got += [mix(hidden[t:t + 1], lambda x, w: causal_conv_step(x, conv_states, slot, w, silu=True),
                    lambda *a: gated_delta_step(*a, delta_states, slot)) for t in range(15, 20)]
    torch.testing.assert_close(torch.cat(got), want, **TOL)
    assert not conv_states[0].any() and not delta_states[0].any()


def padded_batch(tokens: int, seed: int):
    """Three real rows in slots 2, 0, 1 of 4, padded to a bucket of 5 by repeating row 0 (input and slot)."""
    q, k, v, g, beta, _ = delta_inputs(tokens * 3, 2, 4, seed=seed)
    order = torch.tensor([0, 1, 2, 0, 0])
    return [t.view(tokens, 3, *t.shape[1:])[:, order] for t in (q, k, v, g, beta)], torch.tensor([2, 0, 1, 2, 2])


def test_delta_step_with_repeated_padding_slots_equals_each_row_alone():
    (q, k, v, g, beta), slots = padded_batch(6, seed=1)
    _, _, _, _, _, start = delta_inputs(1, 2, 4, seed=2)
    batched = torch.stack([start * (i + 1) for i in range(4)])
    alone = batched.clone()
    for t in range(6):
        got = gated_delta_step(q[t], k[t], v[t], g[t], beta[t], batched, slots)
        for row in range(3):
            want = gated_delta_step(q[t, row:row + 1], k[t, row:row + 1], v[t, row:row + 1], g[t, row:row + 1],
                                    beta[t, row:row + 1], alone, slots[row:row + 1])
            torch.testing.assert_close(got[row:row + 1], want, **TOL)
        torch.testing.assert_close(got[3:], got[:1].expand(2, -1, -1), **TOL)  # padding computes its row 0
    torch.testing.assert_close(batched, alone, **TOL)
    torch.testing.assert_close(batched[3], start * 4, atol=0, rtol=0)  # the unused slot untouched


def test_conv_step_with_repeated_padding_slots_equals_each_row_alone():
    x, weight, bias = conv_inputs(3 * 5, 8, 4, True)
    x = x.view(5, 3, 8)[:, [0, 1, 2, 0, 0]]
    slots = torch.tensor([2, 0, 1, 2, 2])
    batched = torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(3))
    alone = batched.clone()
    for t in range(5):
        got = causal_conv_step(x[t], batched, slots, weight, bias, silu=True)
        for row in range(3):
            want = causal_conv_step(x[t, row:row + 1], alone, slots[row:row + 1], weight, bias, silu=True)
            torch.testing.assert_close(got[row:row + 1], want, **TOL)
        torch.testing.assert_close(got[3:], got[:1].expand(2, -1), **TOL)
    torch.testing.assert_close(batched, alone, atol=0, rtol=0)  # the states hold inputs: copied, never summed


def test_gated_rms_norm_equals_transformers_module():
    gen = torch.Generator().manual_seed(4)
    module = qwen.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(8, generator=gen))
    x, gate = torch.randn(5, 4, 8, generator=gen), torch.randn(5, 4, 8, generator=gen)
    torch.testing.assert_close(gated_rms_norm(x, gate, module.weight.detach(), 1e-6), module(x, gate), **TOL)
    half = gated_rms_norm(x.bfloat16(), gate.bfloat16(), module.weight.detach(), 1e-6)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), module(x.bfloat16(), gate.bfloat16()).float(), atol=0.05, rtol=0.02)


def test_bf16_inputs_come_back_in_bf16_with_an_fp32_state():
    q, k, v, g, beta, start = delta_inputs(20, 2, 4)
    state = start.clone()
    out = gated_delta_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    want, _ = reference_delta(qwen.torch_recurrent_gated_delta_rule, q, k, v, g, beta, start)
    torch.testing.assert_close(out.float(), want, atol=0.05, rtol=0.05)


def test_shape_errors_say_what_to_change():
    q, k, v, g, beta, state = delta_inputs(4, 3, 4)
    with pytest.raises(ValueError, match="not a multiple of 3 key heads"):
        gated_delta_prefill(q, k, v, g, beta, state)
    q, k, v, g, beta, state = delta_inputs(4, 2, 4)
    with pytest.raises(ValueError, match="fp32"):
        gated_delta_prefill(q, k, v, g, beta, state.bfloat16())
    with pytest.raises(ValueError, match=r"states \[S, Hv, dk, dv\] .* got \[4, 16, 8\]"):
        gated_delta_step(q, k, v, g, beta, state, torch.tensor([0, 0, 0, 0]))  # one sequence's state, not the pool
    with pytest.raises(ValueError, match=r"state row \[12, 3\]"):
        causal_conv(torch.zeros(2, 12), torch.zeros(12, 4), torch.zeros(12, 4))


# ---- the decode steps inside a static step ----------------------------------------------------------------------------

def step_both(q, k, v, g, beta, conv_x, delta_states, conv_states, slots, weight):
    return (gated_delta_step(q, k, v, g, beta, delta_states, slots),
            causal_conv_step(conv_x, conv_states, slots, weight, silu=True))


def test_both_steps_trace_whole_and_give_the_eager_numbers():
    """fullgraph=True fails on any graph break (a .item(), a bool() of a tensor, a shape from a value);
    error_on_recompile: new slot values and new inputs reuse the one graph."""
    torch._dynamo.reset()
    (q, k, v, g, beta), slots = padded_batch(4, seed=5)
    conv_x, weight, _ = conv_inputs(4 * 5, 8, 4, False, seed=6)
    conv_x = conv_x.view(4, 5, 8)
    eager = [torch.zeros(4, 4, 16, 8), torch.zeros(4, 8, 3)]
    traced = [s.clone() for s in eager]
    compiled = torch.compile(step_both, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t, rows in enumerate((slots, torch.tensor([1, 3, 0, 1, 1]), slots, torch.tensor([3, 2, 1, 3, 3]))):
            want = step_both(q[t], k[t], v[t], g[t], beta[t], conv_x[t], *eager, rows, weight)
            got = compiled(q[t], k[t], v[t], g[t], beta[t], conv_x[t], *traced, rows, weight)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(traced, eager):
        torch.testing.assert_close(a, b, **TOL)
    assert eager[0].abs().sum() > 0  # the states really moved


def test_steps_read_nothing_on_the_host_and_dispatch_the_same_ops_for_any_slots(monkeypatch):
    (q, k, v, g, beta), slots = padded_batch(2, seed=7)
    conv_x, weight, _ = conv_inputs(2 * 5, 8, 4, False, seed=8)
    conv_x = conv_x.view(2, 5, 8)
    states = [torch.zeros(4, 4, 16, 8), torch.zeros(4, 8, 3)]

    def refuse(*_args, **_kwargs):
        raise AssertionError("a state mixer step read a tensor's value on the host")

    traces = []
    for t, rows in enumerate((slots, torch.tensor([3, 1, 0, 3, 3]))):
        inputs = (q[t], k[t], v[t], g[t], beta[t], conv_x[t])  # selected outside the trace: the step's own ops only
        trace = OpTrace(shapes=True)
        with monkeypatch.context() as patch:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
                patch.setattr(torch.Tensor, name, refuse)
            with torch.inference_mode(), trace:
                step_both(*inputs, *states, rows, weight)
        traces.append(trace)
    assert traces[0].count > 0
    assert traces[0].host_reads == [] and traces[0].device_copies == []
    assert traces[0].calls == traces[1].calls
    assert traces[0].by_name()["aten.index_copy_.default"] == 2  # each state written back once, in place
