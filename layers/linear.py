"""Parallel linear layers (vLLM's family): weights are ``[out, in]`` as in HF checkpoints.

Each parameter carries its tensor-parallel shard spec: column-parallel layers split the output
dim (``shard_dim=0``), row-parallel layers the input dim (``shard_dim=1``, followed by an
all-reduce once TP lands). Shapes here are the full, unsharded ones; sharding is a later
transform driven by the spec, so layers hold no world-size state.
"""
from __future__ import annotations

import enum

from graphdsl import Module, Parameter
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

from .lora import lora_hook

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
           "QKVLayout", "ReplicatedLinear"]


def _positive(name: str, **values):
    for k, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise GraphDSLError(f"{name}: {k} must be a positive int, got {v!r}")


class ColumnParallelLinear(Module):
    """``y = x @ W.T (+ b)``, ``W: [out_features, in_features]`` split along ``out`` under TP."""

    #: online quantization (:func:`graphdsl.layers.quantize.quantize_linears`) may store this weight in
    #: a scheme; False keeps it in the model dtype (MoE routers and gates, as vLLM keeps them)
    online_quantized = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        _positive(type(self).__name__, in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter((out_features, in_features), dtype, shard_dim=0)
        self.bias = Parameter((out_features,), dtype, shard_dim=0) if bias else None

    def forward(self, x):
        return lora_hook(self, x, F.linear(x, self.weight, self.bias, transpose_b=True))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class RowParallelLinear(Module):
    """``y = x @ W.T (+ b)``, ``W`` split along ``in`` under TP (partial sums all-reduced)."""

    online_quantized = True     # as ColumnParallelLinear's

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        _positive(type(self).__name__, in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter((out_features, in_features), dtype, shard_dim=1)
        self.bias = Parameter((out_features,), dtype) if bias else None

    def forward(self, x):
        return lora_hook(self, x, F.linear(x, self.weight, self.bias, transpose_b=True))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate|up).

    Args:
        output_sizes: the parts' output sizes, in order.
        sources: checkpoint module names of the parts (e.g. ``("gate_proj", "up_proj")``); they
            become the checkpoint table (:func:`~graphdsl.layers.checkpoint.checkpoint_layout`).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=None,
                 sources: tuple[str, ...] | None = None):
        output_sizes = list(output_sizes)
        if not output_sizes:
            raise GraphDSLError("MergedColumnParallelLinear: output_sizes must not be empty")
        _positive("MergedColumnParallelLinear", **{f"output_sizes[{i}]": s for i, s in enumerate(output_sizes)})
        super().__init__(in_features, sum(output_sizes), bias, dtype)
        if sources is not None and len(sources) != len(output_sizes):
            raise GraphDSLError(f"MergedColumnParallelLinear: {len(output_sizes)} output_sizes but "
                                f"{len(sources)} sources {sources!r}")
        self.output_sizes, self.sources = output_sizes, tuple(sources or ())
        self.checkpoint_sources_are_siblings = bool(self.sources)

    def forward(self, x):
        """The fused projection ``[..., sum(output_sizes)]`` (callers split or fuse-activate it)."""
        return super().forward(x)

    def checkpoint_slots(self):
        if not self.sources:
            yield from _whole(self)
            return
        start = 0
        for src, size in zip(self.sources, self.output_sizes):
            yield f"{src}.weight", "weight", (slice(start, start + size),), (size, self.in_features)
            if self.bias is not None:
                yield f"{src}.bias", "bias", (slice(start, start + size),), (size,)
            start += size


class QKVLayout(enum.Enum):
    """How a checkpoint stores the q/k/v projection (the parameter is always ``[q | k | v]``)."""

    SEPARATE = "separate"   # q_proj, k_proj, v_proj tensors (Llama, Qwen, Gemma, ...)
    PER_HEAD = "per_head"   # one tensor (this layer's own name), rows [head, (q | k | v), head_dim]: Bloom, GPT-NeoX


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; ``forward`` returns ``(q, k, v)`` as
    ``[tokens, heads, head_dim]`` views.

    Args:
        hidden_size: input features.
        head_dim, num_heads, num_kv_heads: attention geometry (GQA when num_kv_heads < num_heads).
        bias: q/k/v biases (Qwen2).
        sources: checkpoint names of the three parts, default ``("q_proj", "k_proj", "v_proj")``.
        layout: :class:`QKVLayout` of the checkpoint; ``PER_HEAD`` (MHA only) reads one fused tensor
            under this layer's own name and reorders its rows into ``[q | k | v]`` while loading.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype=None, sources: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj"),
                 layout: QKVLayout = QKVLayout.SEPARATE):
        _positive("QKVParallelLinear", head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if num_heads % num_kv_heads:
            raise GraphDSLError(f"QKVParallelLinear: num_heads ({num_heads}) must be a multiple of "
                                f"num_kv_heads ({num_kv_heads})")
        if not isinstance(layout, QKVLayout):
            raise GraphDSLError(f"QKVParallelLinear: layout must be a QKVLayout, one of "
                                f"{[x.value for x in QKVLayout]}, got {layout!r}")
        if layout is QKVLayout.PER_HEAD and num_kv_heads != num_heads:
            raise GraphDSLError(f"QKVParallelLinear: the per-head q/k/v layout needs num_kv_heads == num_heads, "
                                f"got {num_kv_heads} and {num_heads}")
        per_head = layout is QKVLayout.PER_HEAD
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, dtype, None if per_head else sources)
        self.head_dim, self.num_heads, self.num_kv_heads, self.layout = head_dim, num_heads, num_kv_heads, layout

    def checkpoint_slots(self):
        if self.layout is QKVLayout.SEPARATE:
            yield from super().checkpoint_slots()
            return
        h, d, n = self.num_heads, self.head_dim, self.in_features
        yield "weight", "weight", (), (3 * h * d, n), ((h, 3, d, n), (1, 0, 2, 3))
        if self.bias is not None:
            yield "bias", "bias", (), (3 * h * d,), ((h, 3, d), (1, 0, 2))

    def forward(self, x):
        qkv = super().forward(x)
        q, k, v = F.split(qkv, self.output_sizes, -1)
        n, d = _tokens(x), self.head_dim
        return q.reshape(n, self.num_heads, d), k.reshape(n, self.num_kv_heads, d), v.reshape(n, self.num_kv_heads, d)

    def extra_repr(self) -> str:
        return (f"hidden={self.in_features}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, bias={self.bias is not None}")


def _tokens(x):
    """The token count of ``x [tokens, features]`` for reshapes: its (symbolic) dim when known,
    so shapes stay ``num_tokens`` instead of ``num_tokens*a//a`` expressions; else -1."""
    return x.shape[0] if x.shape is not None and len(x.shape) == 2 else -1


def _whole(module: Module):
    for leaf, p in module._parameters.items():
        yield leaf, leaf, (), tuple(p.shape)


class ReplicatedLinear(ColumnParallelLinear):
    """A linear every rank holds whole (MoE routers, tiny gates): no shard spec."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__(in_features, out_features, bias, dtype)
        self.weight.shard_dim = None
        if self.bias is not None:
            self.bias.shard_dim = None
