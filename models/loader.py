"""Fill a model's parameters from checkpoint tensors through its checkpoint table.

One pass over ``(name, tensor)`` pairs (safetensors or GGUF, already in HF names): each tensor is
copied into its slot — a whole parameter, or a slice of a packed one (q/k/v → qkv, gate/up,
per-expert stacks). Shapes are checked as tensors arrive, and at the end one
:class:`~graphdsl.GraphDSLError` lists every missing, unexpected and wrong-shape tensor.
"""
from __future__ import annotations

import sys
import time
from typing import Iterable

import torch

from graphdsl.runtime.loaders.safetensors import check_weights

from .base import FlashCausalLM

__all__ = ["load_weights"]


def load_weights(model: FlashCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], *, device, dtype=None,
                 progress: bool = False) -> dict[str, torch.Tensor]:
    """``{parameter name: tensor on device}`` for every parameter of ``model``.

    Args:
        tensors: checkpoint ``(name, tensor)`` pairs in HF naming (``model.checkpoint_renames`` apply).
        dtype: parameter dtype (default: the model's).
        progress: print a progress line on stderr while reading.
    """
    dtype = dtype or model.dtype
    table = model.checkpoint_table()
    params = dict(model.named_parameters())
    tied = model.tied_parameters()
    out = {name: torch.empty(tuple(p.shape), dtype=p.dtype or dtype, device=device)
           for name, p in params.items() if name not in tied}
    got: dict[str, tuple[int, ...]] = {}
    expected = {name: slot.shape for name, slot in table.items()}
    t0, last = time.monotonic(), 0.0
    for i, (name, tensor) in enumerate(tensors, 1):
        name = model.checkpoint_name(name)
        if model.is_ignored_checkpoint_name(name):
            continue
        got[name] = tuple(tensor.shape)
        slot = table.get(name)
        if slot is not None and tuple(tensor.shape) == slot.shape:
            target = out[slot.param][slot.index]
            target.copy_(slot.place(tensor).reshape(target.shape))
        if progress and time.monotonic() - last > 0.2:
            last = time.monotonic()
            print(f"\rloading weights: {i} tensors ({len(got)}/{len(expected)} matched names) "
                  f"{last - t0:.1f}s", end="", file=sys.stderr, flush=True)
    if progress:
        print(f"\rloading weights: {len(got)} tensors in {time.monotonic() - t0:.1f}s" + " " * 20,
              file=sys.stderr, flush=True)
    check_weights(expected, got)
    for name, source in tied.items():
        out[name] = out[source]
    return out
