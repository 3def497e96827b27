"""The device a profile was measured on, recorded with its results: figures from another power mode, clock
setting, processor or thread count are not comparable, so the JSON and the TOML carry what the probe saw.

Jetson: module, L4T / JetPack, nvpmodel power mode and jetson_clocks (from jtop when its service runs; otherwise
recorded as unknown, with the reason). Elsewhere: the CPU model (/proc/cpuinfo) and the CUDA GPU, if any.
"""

from __future__ import annotations

import os
import platform

import torch


def cpu_model(root: str = "/") -> str:
    """The processor's name from /proc/cpuinfo ('model name' on x86, 'Hardware' / 'Model' on ARM boards)."""
    names: dict[str, str] = {}
    try:
        with open(os.path.join(root, "proc", "cpuinfo"), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Hardware", "Model") and value.strip():
                    names.setdefault(key, value.strip())
    except OSError:
        pass
    name = names.get("model name") or names.get("Model") or names.get("Hardware") or platform.processor()
    return name or platform.machine() or "unknown CPU"


def device_record(device: torch.device, threads: int, root: str = "/") -> dict:
    """What the profile ran on: probe (jetson/probe.py) + CPU model + the compute device and threads."""
    from oval_edge.jetson.probe import probe

    found = probe(root, use_torch=device.type == "cuda")
    record: dict = {
        "kind": found.kind,
        "title": found.title,
        "compute": str(device),
        "cpu": cpu_model(root),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record["gpu"] = props.name
        record["gpu_memory_bytes"] = int(props.total_memory)
        record["cuda"] = torch.version.cuda
    if found.kind == "jetson":
        jtop = found.jtop
        record.update({
            "module": found.module.name if found.module else None,
            "module_how": found.module_how,
            "l4t": found.l4t.version if found.l4t else None,
            "jetpack": found.l4t.jetpack if found.l4t else (jtop.jetpack if jtop else None),
            "nvpmodel": jtop.nvpmodel if jtop else None,
            "jetson_clocks": jtop.jetson_clocks if jtop else None,
            "power_status": jtop.describe() if jtop else found.jtop_status,
        })
    return record


def describe_record(record: dict) -> str:
    """One line for the terminal and the plot title."""
    text = f"{record['title']}, {record['cpu']}"
    if record.get("gpu"):
        text += f", GPU {record['gpu']}"
    if record["kind"] == "jetson":
        clocks = {True: "on", False: "off"}.get(record.get("jetson_clocks"), "unknown")
        text += (f", L4T {record.get('l4t') or '?'}, power mode {record.get('nvpmodel') or 'unknown'}, "
                 f"jetson_clocks {clocks}")
    return text + f"; {record['compute']}, {record['torch_threads']} torch thread(s)"
