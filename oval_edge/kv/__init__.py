"""The KV cache: the page pool allocated once from the budget, the per-step index into it, page summaries."""
