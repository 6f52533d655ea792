"""Feed-forward blocks: the gated MLP of Llama-family decoders, ``down(act(gate(x)) * up(x))`` with
gate|up fused, and the plain two-layer :class:`MLP` ``down(act(up(x)))`` (Bloom, GPT-2 style)."""
from __future__ import annotations

from graphdsl import Module
from graphdsl import functional as F

from .linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

__all__ = ["GatedMLP", "MLP"]


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

    def bind_weights(self, weights: dict, path: str) -> None:
        """An act-order int4 ``down_proj`` (GPTQ ``desc_act``): its input order goes into the
        gate/up rows (:func:`graphdsl.layers.quantize.fold_input_order`), so its rows need no gather."""
        from .quantize import FOLD_INPUT_ORDER, fold_input_order
        if FOLD_INPUT_ORDER and type(self.gate_up_proj) is MergedColumnParallelLinear \
                and type(self.down_proj) is RowParallelLinear:
            fold_input_order(self.gate_up_proj, self.down_proj, weights, parts=2)


class MLP(Module):
    """``down_proj(act(up_proj(x)))``; ``act`` is a plain (not gated) :class:`graphdsl.functional.ActType`."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = True, act=F.ActType.GELU_TANH,
                 dtype=None):
        super().__init__()
        self.act = act
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x):
        return self.down_proj(F.activation(self.up_proj(x), self.act))
