"""Injected modules the injection tests and docs refer to by dotted path."""
from graphdsl import Parameter
from graphdsl import functional as F
from graphdsl.models.injection import InjectedModule

__all__ = ["ScaledRMSNorm", "RenamedNorm"]


class ScaledRMSNorm(InjectedModule):
    """RMSNorm whose output is multiplied by ``scale`` (same ``weight`` Parameter as the original)."""

    def __init__(self, key, config, orig_module, *, scale: float = 2.0, **placement):
        super().__init__(key, config, orig_module, **placement)
        self.eps, self.scale = orig_module.eps, float(scale)
        self.weight = Parameter(tuple(orig_module.weight.shape), orig_module.weight.dtype)

    def forward(self, x, residual=None):
        r = x if residual is None else x + residual
        y = F.rms_norm(r, self.weight, eps=self.eps) * self.scale
        return y if residual is None else (y, r)


class RenamedNorm(ScaledRMSNorm):
    """A norm whose weight has another name: the checkpoint no longer fills it."""

    def __init__(self, key, config, orig_module, **kwargs):
        super().__init__(key, config, orig_module, **kwargs)
        self.gain = self.weight
        del self.weight
