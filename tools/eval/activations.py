"""`oval-edge eval --dtype`: the model loaded once per activation dtype, as `serve --dtype` loads it.

Several dtypes (e.g. float32,bfloat16) decode the fidelity text in lockstep (fidelity.py: every row against the first
dtype's dense row), so what CUDA's bf16 step costs is measured beside fp32 on the same tokens; bf16 runs on a CPU
too (runtime/model/loader.compute_dtype_for), through torch's bf16 matmuls.
"""

from __future__ import annotations

from oval_edge.config import OvalConfig

# 'auto': serve's default for the device (fp32 on a CPU, bf16 on CUDA from compute capability 8.0)
EVAL_DTYPES = ("auto", "float32", "bfloat16", "float16")


def dtype_name(loaded) -> str:
    """'float32', 'bfloat16', ... of a LoadedModel's activations."""
    return str(loaded.dtype).removeprefix("torch.")


def load_models(args, dtypes: list[str], kv_dtypes: tuple[str, ...]) -> list[tuple]:
    """[(LoadedModel, its K/V storages with 'auto' resolved as serve resolves it for that model)], one per distinct
    activation dtype of `dtypes` ('auto' resolved for args.device first), in the order given."""
    from oval_edge.runtime.model.loader import compute_dtype_for, describe, load_model, pick_device

    device = pick_device(args.device)
    names = dict.fromkeys(str(compute_dtype_for(device, d)).removeprefix("torch.") for d in dtypes)
    models = []
    for name in names:
        loaded = load_model(args.model, args.quant, args.device, name)
        print(describe(loaded))
        served_kv = OvalConfig().pool_dtype(loaded.device.type, name)
        models.append((loaded, tuple(dict.fromkeys(served_kv if d == "auto" else d for d in kv_dtypes))))
    return models
