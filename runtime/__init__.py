"""graphdsl.runtime — execution: engines, backends, kernels, caches, loaders."""
from . import gguf_scheme as _gguf_scheme  # noqa: F401 - registers the gguf-* quantization schemes
from .build import build_engine
from .engine import Engine

__all__ = ["Engine", "build_engine"]
