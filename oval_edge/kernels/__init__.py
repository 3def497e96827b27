"""Fused decode kernels with their loaders and self-checks (the CPU C kernels; GPU kernels will live here too).
The torch ops in oval_edge.sparse stay the reference and the fallback."""
