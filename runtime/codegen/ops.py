"""Thin wrappers: the LLM fused ops on real tensors, through the generated kernels.

``add_rms_norm`` and ``silu_mul`` are sub-programs of the generic fused-kernel generator (the same
code path generic fusion uses); ``rope_cache`` has its own kernel (:mod:`.rope_cache`).
"""
from __future__ import annotations

import torch

from .fused import run_fused
from .rope_cache import rope_cache

__all__ = ["add_rms_norm", "silu_mul", "rope_cache", "add_rms_norm_program", "SILU_MUL_PROGRAM"]

SILU_MUL_PROGRAM = (("silu", (0,), ()), ("mul", (2, 1), ()))


def add_rms_norm_program(eps: float):
    """s = x + residual (%3); normed = rms_norm(s, weight) (%4)."""
    return (("add", (0, 1), ()), ("rms_norm", (3, 2), (("eps", float(eps)),)))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """(rms_norm(x + residual, weight), x + residual) in one pass over each row."""
    dt = torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(dt, weight.dtype), device=x.device) if out is None else out
    residual_out = torch.empty(x.shape, dtype=dt, device=x.device) if residual_out is None else residual_out
    run_fused(add_rms_norm_program(eps), (4, 3), [x, residual, weight], [out, residual_out])
    return out, residual_out


def silu_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:], I = x.shape[-1] // 2; the halves are read in place."""
    half = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (half,), dtype=x.dtype, device=x.device) if out is None else out
    run_fused(SILU_MUL_PROGRAM, (3,), [x[..., :half], x[..., half:]], [out])
    return out
