"""OVAL decode over the pool: page scoring, top-k + window selection, exact attention over what was selected,
selection reuse and the output-aware window module."""
