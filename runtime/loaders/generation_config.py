"""The sampling settings a checkpoint recommends, read the way vLLM reads them.

vLLM (``ModelConfig.get_diff_sampling_param``) takes ``repetition_penalty``, ``temperature``,
``top_k``, ``top_p``, ``min_p`` and ``max_new_tokens`` (renamed ``max_tokens``) from a HF model's
``generation_config.json`` — each key that is present and not null, whatever ``do_sample`` says —
and uses them as the defaults of requests that bring no sampling parameters. GGUF files carry the
same recommendations as ``general.sampling.*`` metadata (llama.cpp's ``temp``, ``top_k``, ``top_p``,
``min_p``, ``penalty_repeat``).

Both readers return a plain dict with vLLM's field names (a subset of :data:`FIELDS`); an empty
dict means the checkpoint recommends nothing.
"""
from __future__ import annotations

import os
from typing import Any

from graphdsl.errors import GraphDSLError

from .jsonfile import read_json_object

__all__ = ["FIELDS", "read_generation_config", "gguf_generation_config"]

FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_tokens")

_HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
_INTS = ("top_k", "max_tokens")


def read_generation_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The sampling fields of ``model_dir/generation_config.json`` (``{}`` when there is no file)."""
    file = os.path.join(os.fspath(model_dir), "generation_config.json")
    if not os.path.isfile(file):
        return {}
    return _pick(read_json_object(file), _HF_KEYS, repr(file))


def gguf_generation_config(metadata: dict[str, Any], source: str = "<gguf>") -> dict[str, Any]:
    """The sampling fields of a GGUF file's ``general.sampling.*`` metadata."""
    return _pick(metadata, _GGUF_KEYS, source)


def _pick(data: dict, keys: dict[str, str], source: str) -> dict[str, Any]:
    out = {}
    for key, field in keys.items():
        value = data.get(key)
        if value is None:
            continue
        number = int if field in _INTS else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            kind = "an integer" if field in _INTS else "a number"
            raise GraphDSLError(f"{source}: {key} must be {kind}, got {value!r}")
        out[field] = value if field in _INTS else float(value)
    return out
