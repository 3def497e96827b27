"""Fused decode kernels with their loaders and self-checks: the CPU C kernels (cpu.py) and the GPU Triton kernels
(gpu.py). The torch ops in oval_edge.sparse stay the reference and the fallback."""
