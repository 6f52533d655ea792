"""graphdsl.runtime — execution: engines, backends, kernels, caches, loaders."""
from .build import build_engine
from .engine import Engine

__all__ = ["Engine", "build_engine"]
