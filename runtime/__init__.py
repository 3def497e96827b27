"""oval_edge.runtime: models in (`model/`), the engine that decodes them over the page pool (`engine/`), the HTTP
server (`server/`), the terminal chat and the TOML config file.

The public names below import torch, so they load on first use: the torch-free parts (`model.origin.source`,
`config_file`) stay importable by the planner without it.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "Engine": "oval_edge.runtime.engine.engine",
    "EngineConfig": "oval_edge.runtime.engine.setup",
    "Request": "oval_edge.runtime.engine.request",
    "RequestRejected": "oval_edge.runtime.engine.request",
    "QueueFull": "oval_edge.runtime.engine.request",
    "SamplingParams": "oval_edge.runtime.engine.sampling",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'oval_edge.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
