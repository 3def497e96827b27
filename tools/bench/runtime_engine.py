"""The project's own runtime in a bench worker: OVAL or dense attention over the same page pool and weights.

The pool is sized for what this run holds — one sequence of prompt + generated tokens, plus one page of slack —
the way a user would size it for that context, so the peak RSS is that of a deployment at this context and not
of a pool sized for the model's full 8k positions.
"""

from __future__ import annotations

from .meters import MemoryMeter, TokenClock
from .settings import COUNTED_STEPS, WARMUP_GEN_TOKENS

SLACK_PAGES = 1


def pool_pages(prompt_tokens: int, gen: int, page_size: int) -> int:
    return -(-(prompt_tokens + gen + COUNTED_STEPS) // page_size) + SLACK_PAGES


def run_runtime(job: dict, meter: MemoryMeter, clock: TokenClock) -> dict:
    import torch

    from oval_edge.config import OvalConfig
    from oval_edge.runtime import Engine, EngineConfig, SamplingParams
    from oval_edge.runtime.engine.forward.op_trace import LaunchCount, OpTrace

    torch.set_num_threads(int(job["threads"]))
    prompt, gen = list(job["prompt_ids"]), int(job["gen"])
    tau = job.get("reuse_tau")  # oval+reuse@TAU engines: oval with selection reuse at that cosine
    groups = job.get("group_pages")  # oval+groups@G: G pages a coarse group (0: flat); None: the default
    oval = OvalConfig(page_size=int(job["page_size"]), top_k=int(job["top_k"]),
                      reuse_tau=float(tau) if tau is not None else None,
                      **({} if groups is None else {"group_pages": int(groups)}))
    pages = pool_pages(len(prompt), gen, oval.page_size)
    engine = Engine.load(
        model=job["model"], quant=job["quant"], device=job["device"], oval=oval,
        config=EngineConfig(max_batch=1, max_queue=1, attention="dense" if job["engine"] == "dense" else "oval",
                            num_pages=pages, decode_step=job.get("decode_step", "static"),
                            cuda_graphs=bool(job.get("cuda_graphs", True)), oval_from=job.get("oval_from"),
                            prefix_cache=False),  # the warm-up must not serve the timed prompt's prefill
    )
    engine.generate(list(job["warmup_ids"]), SamplingParams(max_tokens=WARMUP_GEN_TOKENS, ignore_eos=True))
    meter.after_load()

    # One decode step past the timed ones is counted by a dispatch mode: the request asks for gen + COUNTED_STEPS
    # tokens, the clock takes the first gen, and the step that makes the last one runs under the trace (untimed).
    # On CUDA the step's cost is launches (one per kernel eager, one per graph replay), counted by the profiler.
    trace = LaunchCount() if engine.loaded.device.type == "cuda" else OpTrace()
    ticks = []

    def on_token(_request, token_id: int, _text: str) -> None:
        if token_id >= 0 and len(ticks) < gen:  # -1 marks the detokenizer's final text flush, not a token
            clock.tick(token_id)
            ticks.append(token_id)
            if len(ticks) == gen:
                meter.freeze()  # the memory figures end with the timed tokens, before the counted step
                if engine.config.decode_step != "compiled":  # under a dispatch mode a compiled step runs eager
                    engine.next_decode_trace = trace

    # oval+schema: every token is masked by the schema's grammar (filled on the grammar worker during the forward,
    # applied to the host copy of the logits), so the document may end the request: no ignore_eos there.
    grammar = engine.grammars().json_schema(job["schema"]) if job.get("schema") is not None else None
    params = SamplingParams(max_tokens=gen + COUNTED_STEPS, ignore_eos=grammar is None, grammar=grammar)
    clock.begin()  # greedy sampling reads each token back to the host (int(argmax)), so ticks follow the device
    request = engine.generate(prompt, params, on_token=on_token)
    if request.finish_reason not in ("length", "stop"):
        raise RuntimeError(f"the {job['engine']} engine ended the request with {request.finish_reason}: {request.error}")
    if len(ticks) < gen:
        raise RuntimeError(f"the --schema document ended after {len(ticks)} of --gen {gen} tokens; give a schema "
                           "that allows more (an array with a larger minItems) or a smaller --gen")
    geometry = engine.pool.geometry
    # Selection reuse counts (the 32-token warm-up fits the token budget: dense, so it looks nothing up).
    counts = engine.reuse.counts if engine.reuse is not None else None
    graphed = engine.static is not None and engine.static.graphs is not None
    dense_below = f", dense below {engine.oval_from} tokens" if engine.dense_static is not None else ""
    label = f"{job['engine']} ({engine.loaded.quant}, {engine.config.decode_step} decode step" \
            f"{', CUDA graphs' if graphed else ''}{dense_below})"
    if grammar is not None:
        label = f"oval + JSON schema (xgrammar mask per token; {engine.loaded.quant}, {engine.config.decode_step} step)"
    if counts is not None:
        label = f"oval + selection reuse at tau={oval.reuse_tau:g} ({engine.loaded.quant}), " \
                f"{counts.hit_rate:.1%} of row-layer steps reused"
    return {
        "label": label,
        "ops_per_decode_step": trace.count or None,
        "ops_counted": "CUDA launches (profiler)" if isinstance(trace, LaunchCount) else "dispatched torch ops",
        "gpu_kernels_per_decode_step": getattr(trace, "kernels", None),
        "decode_path": engine.describe_decode_step(),
        "decode_step": engine.config.decode_step,
        "reuse_hit_rate": counts.hit_rate if counts is not None else None,
        "reuse_lookups": counts.lookups if counts is not None else None,
        "kv_bytes_per_step": engine.stats.kv_bytes_last_step,
        "kv_bytes_source": "measured: K/V gathered at the last decode step, all layers (engine stats)",
        "summary_bytes_per_step": engine.stats.summary_bytes_last_step,
        # A hybrid's layer states (DeltaNet/conv) every row reads each step: constant in the context length.
        "state_bytes_per_step": engine.stats.state_bytes_last_step,
        "kv_dtype": "int8" if geometry.kv_int8 else geometry.dtype,
        "weight_bytes": engine.loaded.weight_bytes,
        "pool_pages": pages,
        "pool_bytes": engine.pool.nbytes(),
        "tokens_attended_per_layer": engine.stats.attended_per_row_layer,
        # The engine's own timers (forward passes only, no sampling or callbacks) as a cross-check.
        "engine_prefill_s": request.prefill_seconds,
        "engine_decode_s": request.decode_seconds,
        "oval": {"page_size": oval.page_size, "top_k": oval.top_k, "window_max": oval.window_max,
                 "sink_pages": oval.sink_pages, "dense_layers": oval.dense_layers, "scorer": oval.scorer},
    }
