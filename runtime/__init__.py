"""oval_edge.runtime: 4-bit model loading, the paged Llama forward, the engine and the HTTP server."""

from .engine import Engine
from .engine_setup import EngineConfig
from .request import QueueFull, Request, RequestRejected
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "Request", "RequestRejected", "QueueFull", "SamplingParams"]
