"""`oval-edge export-onnx`: the calibrated window module as an ONNX graph with a dynamic batch, checked.

    oval-edge export-onnx --module window.safetensors --out window.onnx

Graph: inputs hidden [batch, sparse layers, hidden size] (float32: each sparse layer's normed hidden state) and
positions [batch] (int64: absolute positions); outputs weights [batch, layers, kv_heads, bins], offset [batch,
layers, kv_heads] and reach [batch, layers, kv_heads] in [0, 1] (window = window_min + reach * (window_max -
window_min)). The module's card (model, geometry, calibration) is copied into the model's metadata_props.

After export the file must pass `onnx.checker` and onnxruntime must agree with PyTorch within --tolerance on
random inputs at every batch size of --check-batches; otherwise the command fails (exit 2) and says by how much.
It uses torch's TorchScript-based exporter (dynamo=False): the dynamo exporter needs onnxscript, which this
project does not install, and the module is a plain static graph that the TorchScript exporter handles.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

OUTPUTS = ("weights", "offset", "reach")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--module", required=True, help="a module written by `oval-edge calibrate` (.safetensors)")
    parser.add_argument("--out", default=None, help="the ONNX file (default: the module's path with .onnx)")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset version")
    parser.add_argument("--check-batches", default="1,3", help="batch sizes compared against onnxruntime")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest allowed |onnxruntime - torch|")


def export_onnx(module, path: str, opset: int = 17) -> str:
    """Write `module` (an OutputAwareModule) as ONNX with a dynamic batch axis; returns the absolute path."""
    import onnx

    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    module = module.eval()
    hidden, positions = random_inputs(module, 2, seed=0)
    batch = {0: "batch"}
    with warnings.catch_warnings():  # the TorchScript exporter announces its deprecation on every call
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (hidden, positions), path, dynamo=False, opset_version=opset,
                          input_names=["hidden", "positions"], output_names=list(OUTPUTS),
                          dynamic_axes={name: batch for name in ("hidden", "positions", *OUTPUTS)})
    model = onnx.load(path)
    entry = model.metadata_props.add()
    entry.key, entry.value = "oval_edge_window_module", module.card.to_json()
    onnx.save(model, path)
    return path


def random_inputs(module, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [batch, Ls, H] with the spread of real states (the module's own input scale), positions [batch]."""
    g = torch.Generator().manual_seed(seed)
    c = module.card
    scale = module.in_scale.detach().cpu().transpose(0, 1)  # [1, Ls, H]
    mean = module.in_mean.detach().cpu().transpose(0, 1)
    hidden = mean + scale * torch.randn(batch, module.sparse_layers, c.hidden_size, generator=g)
    positions = torch.randint(0, c.max_position, (batch,), generator=g)
    return hidden, positions


def check_onnx(module, path: str, batches=(1, 3), seed: int = 0) -> dict[int, float]:
    """onnx.checker, then the largest |onnxruntime - torch| over every output, per batch size."""
    import onnx
    import onnxruntime

    onnx.checker.check_model(onnx.load(path), full_check=True)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    module = module.cpu().eval()
    diffs = {}
    for i, batch in enumerate(batches):
        hidden, positions = random_inputs(module, batch, seed + i)
        with torch.no_grad():
            want = module(hidden, positions)
        got = session.run(list(OUTPUTS), {"hidden": hidden.numpy(), "positions": positions.numpy()})
        if any(tuple(g.shape) != tuple(w.shape) for g, w in zip(got, want)):
            raise ValueError(f"ONNX output shapes {[g.shape for g in got]} differ from torch's "
                             f"{[tuple(w.shape) for w in want]} at batch {batch}")
        diffs[batch] = max(float((torch.from_numpy(g) - w).abs().max()) for g, w in zip(got, want))
    return diffs


def run(args: argparse.Namespace) -> int:
    from oval_edge.sparse.window_module import load_module

    from oval_edge.tools.eval.policies import parse_int_list

    batches = parse_int_list(args.check_batches, "--check-batches", 1, 4096)
    if not 7 <= args.opset <= 23:
        raise ValueError(f"--opset={args.opset} is out of range: allowed [7, 23]")
    if not args.tolerance > 0:
        raise ValueError(f"--tolerance={args.tolerance} must be > 0")
    began = time.perf_counter()
    module = load_module(args.module)  # refuses untrained / uncalibrated files, naming `oval-edge calibrate`
    out = args.out or os.path.splitext(args.module)[0] + ".onnx"
    path = export_onnx(module, out, args.opset)
    diffs = check_onnx(module, path, batches)
    worst = max(diffs.values())
    print(f"wrote {path} ({os.path.getsize(path)} bytes, opset {args.opset}, dynamic batch); onnx.checker: ok")
    for batch, diff in diffs.items():
        print(f"  batch {batch}: max |onnxruntime - torch| = {diff:.3g}")
    if worst > args.tolerance:
        raise ValueError(f"onnxruntime differs from torch by {worst:.3g} > --tolerance {args.tolerance:g}")
    print(f"export-onnx took {time.perf_counter() - began:.1f} s")
    return 0
