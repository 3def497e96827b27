"""torch builds that run on an Orin with JetPack 6, as their wheels spell the version.

NVIDIA tags its own builds as pre-releases of the next version plus a local part (commit, container release).
PEP 440 puts `2.6.0a0+ecf3bae40a.nv25.01` below 2.6.0 (transformers 5 turns torch off for it, as pyproject's
torch>=2.6 refuses it) and `2.7.0a0+79aa17489c.nv25.04` above (pip keeps an installed pre-release that a range
accepts). These strings are what the floor and the resolution check are tested against.
"""

from __future__ import annotations

# version -> where a board gets it
JETPACK_TORCH = {
    "2.5.0a0+872d972e41.nv24.08": "NVIDIA's JetPack 6.1 wheel (developer.download.nvidia.com, jp/v61)",
    "2.6.0a0+ecf3bae40a.nv25.01": "NVIDIA's PyTorch 25.01 container for Jetson (nvcr.io/nvidia/pytorch:25.01-py3-igpu)",
    "2.7.0a0+79aa17489c.nv25.04": "NVIDIA's PyTorch 25.04 container for Jetson (nvcr.io/nvidia/pytorch:25.04-py3-igpu)",
    "2.8.0": "the Jetson AI Lab index for JetPack 6 / CUDA 12.6 (pypi.jetson-ai-lab.io/jp6/cu126), Dockerfile.l4t's",
}
