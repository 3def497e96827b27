"""Measure this machine's entries of the step-cost table (tools/plan/step_cost.py): ops per static decode step
against the layer count, what one dispatched op costs on this CPU, and the host side of a decode step.

    python -m oval_edge.tools.plan.step_probe [--layers 3,6] [--steps 200] [--quant nf4]

Why tiny random models: the static step's op count does not depend on the widths, only on the layers and on which
of them are dense, so models of two depths give ops = a + b_dense * dense + b_sparse * sparse exactly. And with
widths of 64 the arithmetic is negligible, so the step's wall time over its op count is what one op of the real
step costs to dispatch (views, 4-bit calls and native kernels included), not the cost of a synthetic loop.
Nothing is downloaded: the models are random, with the bundled tokenizer.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from oval_edge.tools.timing import clock, gaps, median, repeat_times

PROMPT = 512  # the context docs/static-step.md counted at; the count is the same at every length of a bucket
DENSE_LAYERS = 2  # the serve default (OvalConfig.dense_layers)
# A small vocabulary keeps the output head (read every step) from adding milliseconds of arithmetic to the timing;
# the tokenizer's larger one is harmless, since the probe feeds ids below VOCAB and decodes nothing it reads.
VOCAB = 2048


def _tiny_model(folder: str, layers: int) -> None:
    import torch
    import transformers

    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=layers, vocab_size=VOCAB,
                                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder, safe_serialization=True)
    load_tokenizer(resolve_model("default")).save_pretrained(folder)


def _probe(folder: str, quant: str, attention: str, steps: int, dense_layers: int = DENSE_LAYERS) -> dict:
    """One engine: the op count of one static step, its median wall time, and a whole decode token's."""
    import torch

    from oval_edge import OvalConfig
    from oval_edge.runtime import Engine, EngineConfig, SamplingParams
    from oval_edge.runtime.engine.forward.op_trace import OpTrace

    engine = Engine.load(folder, quant=quant, device="cpu", oval=OvalConfig(page_size=32, top_k=4, dense_layers=dense_layers),
                         config=EngineConfig(max_batch=1, max_model_len=PROMPT + steps + 64, attention=attention,
                                             num_pages=(PROMPT + steps + 64) // 32 + 2, prefix_cache=False))
    prompt = [100 + (i * 7919) % (VOCAB - 200) for i in range(PROMPT)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    engine.generate(prompt[:64], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up: lazy inits, buffers
    stamps: list[float] = []
    engine.generate(prompt, params, on_token=lambda _r, token, _t: token >= 0 and stamps.append(clock()))
    # The engine's whole loop per token (step, read back, sampling, detokenizing, scheduling); medians, like the
    # step's below, so that a stall of this shared machine moves neither.
    per_token = median(gaps(stamps))
    # The step alone, on a sequence held at PROMPT tokens (run() does not advance it; its shapes do not follow it).
    seq = "probe"
    assert engine.pool.allocate(seq, PROMPT + 1) is not None
    ids = torch.tensor(prompt, dtype=torch.long)
    for start in range(0, PROMPT, 256):
        step = engine.pool.prepare([seq], [len(ids[start:start + 256])])
        engine.runner.forward(step, ids[start:start + 256], decode=False)
        engine.pool.commit(step)
    static = engine.static.step_for(1)
    static.load([seq], [7])
    trace = OpTrace()
    with torch.inference_mode():
        with trace:
            static.run()
        run_s = median(repeat_times(static.run, steps))
    return {"ops": trace.count, "step_run_ms": run_s * 1e3, "us_per_op": run_s / trace.count * 1e6,
            "decode_token_ms": per_token * 1e3, "host_outside_step_us": (per_token - run_s) * 1e6}


def _fit(points: dict[int, int]) -> tuple[float, float]:
    """ops = base + per_layer * layers through two depths (exact: the count is affine in the layers)."""
    (l1, o1), (l2, o2) = sorted(points.items())[:2]
    per_layer = (o2 - o1) / (l2 - l1)
    return o1 - per_layer * l1, per_layer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oval_edge.tools.plan.step_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="3,6", help="two model depths, comma-separated (each > 2)")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per engine")
    parser.add_argument("--quant", default="auto", help="weights: auto, gguf, int4, nf4, fp4 or none")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (profile's default: 1)")
    args = parser.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",")]
    if len(depths) != 2 or min(depths) <= DENSE_LAYERS or depths[0] == depths[1]:
        raise SystemExit(f"--layers={args.layers!r}: give two different depths above {DENSE_LAYERS}, e.g. 3,6")
    import torch

    torch.set_num_threads(args.threads)
    out: dict = {"quant": args.quant, "threads": args.threads, "prompt": PROMPT, "runs": {}}
    for layers in depths:
        with tempfile.TemporaryDirectory() as folder:
            _tiny_model(folder, layers)
            for attention in ("oval", "dense"):
                out["runs"][f"{attention}/{layers}"] = _probe(folder, args.quant, attention, args.steps)
            if layers == max(depths):  # one dense layer fewer: what a dense layer costs inside the OVAL step
                out["runs"][f"oval/{layers}/dense1"] = _probe(folder, args.quant, "oval", args.steps, 1)
    deep = max(depths)
    oval_base, per_sparse = _fit({n: out["runs"][f"oval/{n}"]["ops"] for n in depths})
    per_dense = per_sparse - (out["runs"][f"oval/{deep}/dense1"]["ops"] - out["runs"][f"oval/{deep}"]["ops"])
    # ops = base + per_dense * dense + per_sparse * (layers - dense); the fitted intercept holds the 2 dense layers.
    out["fit"] = {"base": oval_base - (per_dense - per_sparse) * DENSE_LAYERS, "per_dense_layer": per_dense,
                  "per_sparse_layer": per_sparse,
                  "dense_attention_engine": dict(zip(("base", "per_layer"),
                                                     _fit({n: out["runs"][f"dense/{n}"]["ops"] for n in depths})))}
    runs = out["runs"].values()
    out["us_per_op_median"] = median(r["us_per_op"] for r in runs)
    out["host_outside_step_us_median"] = median(r["host_outside_step_us"] for r in runs)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
