"""The GPU kernels in Triton (scoring over records in place, attention over selected pool rows, the grouped 4-bit
projection, the int8 head, the gated delta rule step), their shared helpers and their startup self-checks;
`oval_edge/kernels/gpu.py` loads them."""
