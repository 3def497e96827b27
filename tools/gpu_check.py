"""`make gpu-check`: the prepared check for a machine with a CUDA GPU, in one script that fits a 10-minute slot.

Stages, each with its own time limit, each printed as it ends:
  1. the device: name, compute capability, memory, which kernels and activation dtype the runtime picks there;
  2. the CUDA tests (tests/test_gpu.py: nf4 load, graph replay == eager logits in fp16/bf16, greedy equality, the
     Triton kernels vs the torch ops on the GPU), the int8 embedding/head on CUDA (tests/test_int8_head.py: the
     Triton head and its torch fallback against the dequantized matmul, captured in a graph, the loader's bytes
     against plan's) and the CPU-side tests of the same paths and of the Triton kernels in the interpreter
     (tests/test_cuda_paths.py, tests/test_triton_kernels.py);
  3. the ways to multiply a batch by a 4-bit weight, timed side by side (tools/experiments/four_bit_paths.py);
  4. `oval-edge bench` on the GPU at 512 and 8k tokens, oval and dense, the static step replayed from CUDA graphs:
     decode tok/s, launches per step and effective GB/s against the device's bandwidth;
  5. the same bench for oval with --no-cuda-graphs (the eager static step): what the graphs buy.
Without a CUDA device it says so and exits 0, so it can sit in any checklist. Results go to --out (default
build/gpu-check, or $OUT when set): bench JSON files and a summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# Stage limits: the tests' allows for a cold Triton cache (a fresh device compiles every kernel the tests launch
# once); together they leave a minute of a 10-minute device slot for the start and the transfers.
STAGES_S = {"tests": 270, "four_bit": 30, "bench": 170, "bench_eager": 70}
LIMIT_S = sum(STAGES_S.values())
TESTS = ("tests/test_gpu.py", "tests/test_int8_head.py", "tests/test_cuda_paths.py", "tests/test_triton_kernels.py",
         "tests/test_triton_grouped.py")
REQUIRED = ("oval_edge.runtime", "bitsandbytes", "gguf", "transformers", "fastapi")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join("build", "gpu-check"))
    parser.add_argument("--bandwidth", type=float, default=None, help="device bandwidth in GB/s (default: probed)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed in this Python; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              "nothing to check, exiting 0")
        return 0
    missing = [name for name in REQUIRED if not _imports(name)]
    if missing:
        print(f"gpu-check: this Python lacks {', '.join(missing)}: install the project into it first "
              "(`pip install -e .[test]` with a CUDA torch, or `make setup TORCH_SPEC=torch`)")
        return 1
    os.makedirs(args.out, exist_ok=True)
    began, summary = time.perf_counter(), {"device": describe_device()}
    print("gpu-check: device", json.dumps(summary["device"]), flush=True)
    summary["tests"] = run_stage("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS])
    summary["four_bit"] = run_stage("four_bit", [sys.executable, "-m", "oval_edge.tools.experiments.four_bit_paths"])
    bandwidth = ["--bandwidth", str(args.bandwidth)] if args.bandwidth else []
    common = [sys.executable, "-m", "oval_edge.cli", "bench", "--device", "cuda", "--contexts", "512,8192",
              "--runs", "1", "--gen", "64", "--no-progress", *bandwidth]
    graphed = os.path.join(args.out, "bench-graphs.json")
    summary["bench"] = run_stage("bench", [*common, "--engines", "oval,dense", "--json", graphed])
    eager = os.path.join(args.out, "bench-eager.json")
    summary["bench_eager"] = run_stage("bench_eager", [*common, "--engines", "oval", "--no-cuda-graphs",
                                                       "--json", eager])
    summary["figures"] = [*bench_figures(graphed, "graphs"), *bench_figures(eager, "eager")]
    summary["seconds"] = round(time.perf_counter() - began, 1)
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    print_summary(summary)
    return 0 if all(summary[s]["rc"] == 0 for s in STAGES_S) else 1


def describe_device() -> dict:
    import torch

    from oval_edge.kernels.cpu import describe_kernels
    from oval_edge.kernels.gpu import load_int8_head
    from oval_edge.runtime.model.loader import compute_dtype_for

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    head = load_int8_head("cuda", False)  # the int8 head's Triton kernel, checked, or why not
    return {"name": props.name, "capability": list(torch.cuda.get_device_capability(device)),
            "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "kernels": describe_kernels(device),
            "int8_head": head if isinstance(head, str) else "Triton (checked)",
            "activations": str(compute_dtype_for(device)).removeprefix("torch.")}


def run_stage(name: str, command: list[str]) -> dict:
    print(f"gpu-check: {name}: {' '.join(command)}", flush=True)
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=STAGES_S[name],
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = 124, f"{exc.stdout or ''}{exc.stderr or ''}\n(stopped after {STAGES_S[name]} s)"
    tail = output if isinstance(output, str) else output.decode(errors="replace")
    print(tail[-6000:], flush=True)
    seconds = round(time.perf_counter() - began, 1)
    print(f"gpu-check: {name}: rc {rc} in {seconds} s", flush=True)
    return {"rc": rc, "seconds": seconds, "tail": tail[-2000:]}


def bench_figures(path: str, label: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        rows = json.load(handle).get("rows", [])
    keep = ("engine", "context", "decode_tok_s", "prefill_tok_s", "ops_per_decode_step",
            "gpu_kernels_per_decode_step", "effective_gb_s", "bandwidth_fraction", "run_peak_device_mb")
    return [{"steps": label, **{k: row.get(k) for k in keep}} for row in rows]


def print_summary(summary: dict) -> None:
    print("\ngpu-check summary", json.dumps(summary["device"]))
    for stage in STAGES_S:
        print(f"  {stage:12s} rc {summary[stage]['rc']} in {summary[stage]['seconds']} s")
    print(f"  {'steps':7s} {'engine':6s} {'context':>7s} {'decode tok/s':>12s} {'launches':>8s} {'kernels':>7s} "
          f"{'GB/s':>7s} {'of peak':>7s}")
    for f in summary["figures"]:
        print(f"  {f['steps']:7s} {f['engine']:6s} {f['context']:>7} {_fmt(f['decode_tok_s'], '{:.1f}'):>12s} "
              f"{_fmt(f['ops_per_decode_step'], '{:.0f}'):>8s} {_fmt(f['gpu_kernels_per_decode_step'], '{:.0f}'):>7s} "
              f"{_fmt(f['effective_gb_s'], '{:.1f}'):>7s} {_fmt(f['bandwidth_fraction'], '{:.1%}'):>7s}")
    print(f"  total {summary['seconds']} s (limit {LIMIT_S} s)")


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _imports(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
