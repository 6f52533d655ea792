"""Model configs: one pydantic model parsed once from HF ``config.json``, chosen by a builder table.

Both HF layouts are read: transformers 4 (``rope_theta`` + ``rope_scaling``, what published
checkpoints ship) and transformers 5 (``rope_parameters``, what ``save_pretrained`` writes now).
A :class:`ConfigBuilder` has ``condition(hf) -> bool`` and ``build(hf) -> ModelConfig``; builders
are tried newest-registered first (so a custom builder overrides a built-in one).
"""
from __future__ import annotations

import json
import os
import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from graphdsl.errors import GraphDSLError
from graphdsl.layers import RopeScaling, RopeType
from graphdsl.runtime.loaders.jsonfile import read_json_object

__all__ = ["ModelConfig", "ConfigBuilder", "register_config_builder", "build_config", "read_hf_config",
           "parse_rope", "UnsupportedModelError"]


class UnsupportedModelError(GraphDSLError):
    """The checkpoint asks for something graphdsl does not implement (listed in the message)."""


class ModelConfig(BaseModel):
    """The decoder-only transformer geometry every supported family is built from."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    model_type: str
    architectures: tuple[str, ...] = ()
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()     # per layer: uses sliding_window (empty: all do when set)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # mixture of experts (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, i: int) -> int | None:
        if not self.sliding_window:
            return None
        return self.sliding_window if not self.sliding_layers or self.sliding_layers[i] else None

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.num_experts) and (not self.moe_layers or self.moe_layers[i])

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype)


class ConfigBuilder:
    """Turns an HF config dict into a :class:`ModelConfig` (lmdeploy's ConfigBuilder shape)."""

    @classmethod
    def condition(cls, hf: dict) -> bool:
        raise NotImplementedError

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        raise NotImplementedError


_BUILDERS: list[type[ConfigBuilder]] = []


def register_config_builder(builder: type[ConfigBuilder]) -> type[ConfigBuilder]:
    """Class decorator: add ``builder`` to the table (tried before those registered earlier)."""
    if builder in _BUILDERS:
        _BUILDERS.remove(builder)
    _BUILDERS.insert(0, builder)
    return builder


def config_builders() -> list[type[ConfigBuilder]]:
    return list(_BUILDERS)


def read_hf_config(path: str | os.PathLike) -> dict:
    """``config.json`` of a model directory (plus eos ids from ``generation_config.json``)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise GraphDSLError(f"no config.json at {path!r}: pass a HF model directory or a .gguf file")
    hf = read_json_object(file)
    gen = os.path.join(os.path.dirname(file), "generation_config.json")
    if os.path.isfile(gen):
        try:
            with open(gen, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                hf["_generation_eos_token_id"] = eos
        except (OSError, json.JSONDecodeError, AttributeError):
            pass
    return hf


def build_config(hf: dict) -> ModelConfig:
    """The first builder whose ``condition`` holds builds the config; none: an error listing them."""
    from .registry import _load_builtin
    _load_builtin()
    for builder in _BUILDERS:
        if builder.condition(hf):
            try:
                return builder.build(hf)
            except ValidationError as e:
                raise GraphDSLError(f"{builder.__name__}: config.json of model_type {hf.get('model_type')!r} "
                                    f"is invalid: {e}") from None
            except KeyError as e:
                raise GraphDSLError(f"{builder.__name__}: config.json of model_type {hf.get('model_type')!r} "
                                    f"lacks the field {e}") from None
    from .registry import supported_model_types
    raise UnsupportedModelError(f"unknown model_type {hf.get('model_type')!r} (architectures "
                                f"{hf.get('architectures')}); supported model types: {supported_model_types()}")


# -- helpers for builders ------------------------------------------------------------------------
def parse_rope(hf: dict) -> tuple[float, RopeScaling | None, float]:
    """``(rope_theta, scaling or None, partial_rotary_factor)`` from either HF layout."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"per-layer-type rope_parameters ({sorted(params)}) are not supported")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = params
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or {}
        partial = hf.get("partial_rotary_factor", 1.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    known = [t.value for t in RopeType]
    if kind not in known:
        raise UnsupportedModelError(f"rope type {kind!r} is not supported; supported: {known}")
    if kind == "default":
        return float(theta), None, float(partial)
    fields = {k: scaling[k] for k in ("factor", "original_max_position_embeddings", "low_freq_factor",
                                      "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                      "attention_factor", "truncate") if scaling.get(k) is not None}
    if kind == "yarn" and "factor" not in fields and fields.get("original_max_position_embeddings"):
        fields["factor"] = hf["max_position_embeddings"] / fields["original_max_position_embeddings"]
    if kind == "dynamic":
        fields.pop("original_max_position_embeddings", None)
    return float(theta), RopeScaling(rope_type=RopeType(kind), **fields), float(partial)


def eos_ids(hf: dict) -> tuple[int, ...]:
    out: list[int] = []
    for key in ("eos_token_id", "_generation_eos_token_id"):
        v = hf.get(key)
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, int) and x not in out:
                out.append(x)
    return tuple(out)


def dense_fields(hf: dict) -> dict:
    """Fields every Llama-like config shares, read the same way for all families."""
    heads = hf["num_attention_heads"]
    theta, scaling, partial = parse_rope(hf)
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in ("float32", "float16", "bfloat16"):
        dtype = "float32"
    return dict(
        model_type=hf["model_type"], architectures=tuple(hf.get("architectures") or ()),
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        hidden_act=hf.get("hidden_act", "silu"), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 2048), rope_theta=theta, rope_scaling=scaling,
        partial_rotary_factor=partial, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids(hf), torch_dtype=dtype,
    )


def sliding_fields(hf: dict) -> dict:
    """Sliding-window attention as HF Mistral/Qwen2 express it."""
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return {}
    types = hf.get("layer_types")
    layers = tuple(t == "sliding_attention" for t in types) if types else ()
    return {"sliding_window": int(window), "sliding_layers": layers}


ACTIVATIONS: dict[str, str] = {"silu": "SWIGLU", "swish": "SWIGLU", "gelu_pytorch_tanh": "GEGLU",
                               "gelu_tanh": "GEGLU"}


def check_activation(hf: dict) -> None:
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")

