"""The model registry: architecture / model_type → FlashCausalLM class, plus external module maps.

Register a class with ``@register_model(architectures=[...], model_types=[...])``. Lookup tries the
checkpoint's ``architectures`` first, then its ``model_type``. ``load_custom_module_map(file)``
executes a user's Python file; it may register models/config builders with the decorators or
define ``MODULE_MAP = {"ArchitectureName": "pkg.module.Class" | Class}`` (lmdeploy's
``custom_module_map``), so a model is added or replaced without forking graphdsl.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from graphdsl.errors import GraphDSLError

__all__ = ["register_model", "resolve_model_class", "supported_model_types", "supported_architectures",
           "load_custom_module_map"]

_BY_ARCH: dict[str, type] = {}
_BY_TYPE: dict[str, type] = {}


def register_model(*, architectures=(), model_types=()):
    """Class decorator adding a FlashCausalLM subclass under HF architecture names and model types."""
    if not architectures and not model_types:
        raise GraphDSLError("register_model: give at least one architecture or model_type")

    def deco(cls):
        for a in architectures:
            _BY_ARCH[a] = cls
        for t in model_types:
            _BY_TYPE[t] = cls
        return cls
    return deco


def supported_model_types() -> list[str]:
    _load_builtin()
    return sorted(_BY_TYPE)


def supported_architectures() -> list[str]:
    _load_builtin()
    return sorted(_BY_ARCH)


def resolve_model_class(model_type: str, architectures=()) -> type:
    """The registered class for a checkpoint; an error listing what is supported otherwise."""
    _load_builtin()
    for a in architectures or ():
        if a in _BY_ARCH:
            return _BY_ARCH[a]
    if model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    from .config import UnsupportedModelError
    raise UnsupportedModelError(f"unknown model_type {model_type!r} (architectures {list(architectures or ())}); "
                                f"supported model types: {sorted(_BY_TYPE)}; supported architectures: "
                                f"{sorted(_BY_ARCH)}. Add one with a custom_module_map file (docs/add-a-model.md).")


def load_custom_module_map(path: str | os.PathLike) -> None:
    """Execute ``path`` (a .py file) and register what it defines; see the module docstring."""
    path = os.fspath(path)
    if not os.path.isfile(path) or not path.endswith(".py"):
        raise GraphDSLError(f"custom_module_map must be an existing .py file, got {path!r}")
    _load_builtin()
    name = f"graphdsl_custom_module_map_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise GraphDSLError(f"custom_module_map {path!r} failed to import: {type(e).__name__}: {e}") from e
    mapping = getattr(module, "MODULE_MAP", {}) or {}
    if not isinstance(mapping, dict):
        raise GraphDSLError(f"custom_module_map {path!r}: MODULE_MAP must be a dict, got {type(mapping).__name__}")
    for arch, target in mapping.items():
        cls = _import_target(target, path) if isinstance(target, str) else target
        if not isinstance(cls, type):
            raise GraphDSLError(f"custom_module_map {path!r}: MODULE_MAP[{arch!r}] must be a class or "
                                f"'module.Class' path, got {target!r}")
        _BY_ARCH[arch] = cls
        for t in getattr(cls, "model_types", ()):
            _BY_TYPE[t] = cls


def _import_target(target: str, path: str):
    mod, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise GraphDSLError(f"custom_module_map {path!r}: cannot import {target!r}: {e}") from None


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        # imported for their registration side effects
        from . import bloom, deepseek_v2, gemma, llama, mixtral, qwen2, qwen2_moe, qwen3  # noqa: F401
