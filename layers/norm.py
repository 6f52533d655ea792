"""Normalisations: :class:`RMSNorm` (optionally fused with the residual add), Gemma's
:class:`GemmaRMSNorm` and :class:`LayerNorm`."""
from __future__ import annotations

from graphdsl import Module, Parameter
from graphdsl import functional as F

__all__ = ["RMSNorm", "GemmaRMSNorm", "LayerNorm"]


class RMSNorm(Module):
    """``y = w * x / sqrt(mean(x²) + eps)`` over the last dim (float32 inside, HF Llama order).

    ``norm(x)`` returns ``y``. ``norm(x, residual)`` first adds: ``r = x + residual`` and returns
    ``(norm(r), r)`` — the new residual stream — which is the add+norm pair a fusion pass merges.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, float(eps)
        self.weight = Parameter((hidden_size,), dtype)

    def forward(self, x, residual=None):
        if residual is None:
            return self._norm(x)
        r = x + residual
        return self._norm(r), r

    def _norm(self, x):
        return F.rms_norm(x, self.weight, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``w`` and the scale is ``1 + w``, applied in float32
    before the cast back (HF order): ``y = ((1 + w) * x / sqrt(mean(x²) + eps)).to(x.dtype)``. The
    ``1 + w`` depends on the weight only, so it is folded once when weights are bound."""

    def _norm(self, x):
        return F.rms_norm(x.float(), self.weight.float() + 1.0, eps=self.eps).to(x)


class LayerNorm(Module):
    """``y = (x - mean) / sqrt(var + eps) * w (+ b)`` over the last dim; residual form as RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, float(eps)
        self.weight = Parameter((hidden_size,), dtype)
        self.bias = Parameter((hidden_size,), dtype) if bias else None

    def forward(self, x, residual=None):
        if residual is None:
            return F.layer_norm(x, self.weight, self.bias, eps=self.eps)
        r = x + residual
        return F.layer_norm(r, self.weight, self.bias, eps=self.eps), r

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}"
