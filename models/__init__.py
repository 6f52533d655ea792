"""graphdsl.models — architectures, their configs, the registry, ``FlashCausalLM`` + ``to_engine``.

The user entry points built on them (``LLM``, the CLI) are in :mod:`graphdsl.entrypoints`."""
from .base import FlashCausalLM, to_engine
from .config import (ConfigBuilder, ModelConfig, UnsupportedModelError, build_config, read_hf_config,
                     register_config_builder)
from .registry import (load_custom_module_map, register_model, resolve_model_class, supported_architectures,
                       supported_model_types)

__all__ = ["FlashCausalLM", "to_engine", "ModelConfig", "ConfigBuilder", "register_config_builder", "build_config",
           "read_hf_config", "UnsupportedModelError", "register_model", "resolve_model_class",
           "supported_model_types", "supported_architectures", "load_custom_module_map", "check_model"]


def __getattr__(name):
    if name == "check_model":
        from .check import check_model
        return check_model
    raise AttributeError(f"module 'graphdsl.models' has no attribute {name!r}")
