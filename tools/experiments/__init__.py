"""One-question experiments: each answered a design question once, and its figures are in docs/ with the command
that reproduces them (routing and failover behind a router, the cost of a metrics scrape: docs/fleet.md; the ways
to multiply a batch by a 4-bit weight: docs/gpu-decode.md, run by `make gpu-check`). They run from a checkout
(`python -m oval_edge.tools.experiments.NAME`); setup.py leaves them out of the wheel, which ships what users run.
"""
