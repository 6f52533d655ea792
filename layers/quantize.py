"""Online quantization of a module tree: mark its linear weights with a scheme, then turn loaded
full-precision weights into the scheme's stored tensors (the companions ``F.linear`` reads).

Only the projections of :mod:`graphdsl.layers.linear` are quantized (attention, MLP, and whatever
else is built from them); embeddings, norms, MoE expert stacks and, by default, ``lm_head`` stay
in the model dtype.
"""
from __future__ import annotations

from typing import Mapping

import torch

from graphdsl import Module
from graphdsl.errors import GraphDSLError
from graphdsl.quant import IntScheme, QuantMethod, QuantScheme, online_scheme

from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["quantize_linears", "quantize_weights"]


def quantize_linears(model: Module, scheme: QuantScheme | str, *, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Set ``scheme`` on every linear weight of ``model`` but the modules at paths in ``skip``;
    return the quantized parameter names. The bare method ``"int4"`` takes groups of 128, or 64 / 32
    for a weight whose input count 128 does not divide. A weight the scheme cannot hold (an input count not a
    multiple of the group) is an error naming it and the scheme."""
    adapt = scheme in (QuantMethod.INT4, QuantMethod.INT4.value)
    scheme = online_scheme(scheme)
    dict(model.named_parameters())                      # name every parameter first
    names = []
    for path, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and path not in skip:
            m.weight.quantize(_int4_group(scheme, m.in_features) if adapt else scheme)
            names.append(m.weight.name)
    return names


def _int4_group(scheme: IntScheme, in_features: int) -> IntScheme:
    """The bare ``int4`` method: groups of 128 where they divide the inputs, else the largest of 64
    and 32 that does (SmolLM2's 576 inputs take 64); else ``scheme`` (whose check then names the
    weight)."""
    for g in (128, 64, 32):
        if in_features % g == 0:
            return IntScheme(4, g, scheme.zero_point)
    return scheme


def quantize_weights(model: Module, weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) \
        -> dict[str, torch.Tensor]:
    """``weights`` with each quantized parameter's full tensor replaced by its companions (scales in
    ``dtype``, default the weight's), quantized one parameter at a time so only one extra copy
    is alive at once."""
    out = dict(weights)
    for name, p in model.named_parameters():
        if p.quant is None:
            continue
        w = out.pop(name, None)
        if w is None:
            raise GraphDSLError(f"quantize_weights: parameter {name!r} ({p.quant.name}) has no loaded tensor")
        if tuple(w.shape) != tuple(p.shape):
            raise GraphDSLError(f"quantize_weights: parameter {name!r} ({p.quant.name}) should be {list(p.shape)}, "
                                f"got {list(w.shape)}")
        for c, t in zip(p.companions(), p.quant.quantize(w, dtype or w.dtype)):
            out[c.name] = t
        del w
    return out
