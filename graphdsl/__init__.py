"""graphdsl — define LLMs as torch-like Python modules, compile them into static engines.

The whole public surface of the language is re-exported here::

    import graphdsl as gd
    from graphdsl import Tensor, Dim, Network, get_default_net, functional as F
"""
from . import functional, nn
from .dim import Dim
from .errors import BindError, GraphDSLError, ShapeError
from .network import Network, get_default_net
from .nn import Module, ModuleList, Parameter
from .opdef import OpCategory, RuntimeParam, Spec, register_op, same_as
from .tensor import Tensor

__version__ = "0.1.0"

__all__ = ["Tensor", "Dim", "Network", "get_default_net", "functional", "nn", "Module", "ModuleList",
           "Parameter", "register_op", "OpCategory", "Spec", "same_as", "RuntimeParam", "GraphDSLError",
           "ShapeError", "BindError", "__version__", "LLM", "SamplingParams",
           "LoRARequest"]


def __getattr__(name):
    """Lazy re-exports of the model-level API (``gd.LLM``, ``gd.SamplingParams``), so importing the
    language does not import the model and runtime rooms."""
    if name == "LLM":
        from graphdsl.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from graphdsl.runtime.serving.sampling import SamplingParams
        return SamplingParams
    if name == "LoRARequest":
        from graphdsl.models.lora import LoRARequest
        return LoRARequest
    raise AttributeError(f"module 'graphdsl' has no attribute {name!r}")
