"""The gated MLP of Llama-family decoders: ``down(act(gate(x)) * up(x))`` with gate|up fused."""
from __future__ import annotations

from graphdsl import Module
from graphdsl import functional as F

from .linear import MergedColumnParallelLinear, RowParallelLinear

__all__ = ["GatedMLP"]


class GatedMLP(Module):
    """Args: ``act`` is a gated :class:`graphdsl.functional.ActType` (SWIGLU for SiLU, GEGLU for
    tanh-GELU); ``sources`` names the checkpoint's gate/up tensors."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act=F.ActType.SWIGLU,
                 dtype=None, sources: tuple[str, str] = ("gate_proj", "up_proj")):
        super().__init__()
        self.act = act
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, dtype, sources)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x):
        return self.down_proj(F.activation(self.gate_up_proj(x), self.act))
