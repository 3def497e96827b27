"""Projections held as grouped integer codes: the layout (layout.py), a GGUF's blocks converted to it
(gguf_blocks.py), and the module with its per-device op (linear.py)."""
