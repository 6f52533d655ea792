"""LoRA on the parallel linears: what an engine with the ``lora`` feature records.

A targeted linear computes ``y = x·Wᵀ (+ b)`` and then ``F.lora_apply(y, x, A, B, lora_indices)``:
``out[t] = y[t] + (x[t]·A[s]ᵀ)·B[s]ᵀ`` with ``s = lora_indices[t]`` (``-1``: no adapter). ``A`` and
``B`` are graph inputs named ``lora.{module path}.A`` / ``.B`` — bound like weights, so a new
adapter is a copy into them, never a rebuild:

* ``A [slots, parts·rank, in]`` — a fused linear (q|k|v, gate|up) stacks its parts' A factors;
* ``B [out, slots, parts·rank]`` — block-diagonal over the parts, scaling folded in (output-major:
  all slots' B are one ``[out, slots·parts·rank]`` matrix for the dense many-token path).

Outside :func:`lora_scope` the hook records nothing, so an engine without the feature is the same
graph as a model without LoRA. The ``lora_epilogue`` rules then fold each ``lora_apply`` into its
projection (``matmul_lora``, ``matmul_silu_mul_lora``, ``matmul_add_lora``; docs/lora.md).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from graphdsl import Dim, Tensor
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

__all__ = ["LoRATarget", "lora_scope", "lora_hook", "LORA_INDICES", "lora_weight_names"]

LORA_INDICES = "lora_indices"
_STATE = threading.local()


@dataclass(frozen=True)
class LoRATarget:
    """One adapted linear: its input and output features and its fused parts' output sizes."""

    in_features: int
    out_features: int
    parts: tuple[int, ...]


def lora_weight_names(path: str) -> tuple[str, str]:
    """The graph input names of module ``path``'s A and B slot buffers."""
    return f"lora.{path}.A", f"lora.{path}.B"


@contextmanager
def lora_scope(targets: dict[str, LoRATarget], num_slots: int, max_rank: int):
    """Record LoRA on the linears named in ``targets`` (module path → geometry) while active;
    yields the ``lora_indices [num_tokens]`` int32 graph input."""
    if getattr(_STATE, "scope", None) is not None:
        raise GraphDSLError("lora_scope: already recording LoRA (scopes do not nest)")
    indices = Tensor(LORA_INDICES, (Dim("num_tokens"),), torch.int32)
    _STATE.scope = (targets, num_slots, max_rank, indices)
    try:
        yield indices
    finally:
        _STATE.scope = None


def lora_hook(module, x, y):
    """``y`` plus the module's LoRA term when recording under :func:`lora_scope` and the module is
    a target; ``y`` itself otherwise (the hook of every parallel linear's ``forward``)."""
    scope = getattr(_STATE, "scope", None)
    if scope is None:
        return y
    targets, slots, rank, indices = scope
    target = targets.get(module._path)
    if target is None:
        return y
    width = rank * len(target.parts)
    a_name, b_name = lora_weight_names(module._path)
    a = Tensor(a_name, (slots, width, target.in_features), x.dtype)
    b = Tensor(b_name, (target.out_features, slots, width), x.dtype)
    return F.lora_apply(y, x, a, b, indices)
