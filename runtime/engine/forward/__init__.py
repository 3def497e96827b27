"""The model's forward against the page pool: the paged Llama-family forward (prefill, eager decode, mixed steps),
the static decode step, its CUDA graphs, and the op counter that measures a step."""
