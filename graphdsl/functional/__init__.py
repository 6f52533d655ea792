"""graphdsl.functional — the ops model code calls on fake tensors (``import ... as F``).

Each op is registered once with its shape rule, torch reference and category (see
:mod:`graphdsl.opdef`); the functions here record nodes into the current network.
"""
from .attention import RopeLayout, paged_attention, paged_mla_attention, reshape_and_cache, rope
from .collective import all_gather, all_reduce, reduce_scatter
from .lora import lora_apply
from .matmul import bmm, linear, matmul
from .moe import moe_experts, quant_moe_experts
from .movement import (cat, embedding, expand, gather, getitem, index_mask, permute, reshape, slice, split,
                       squeeze, transfer, transpose, unsqueeze)
from .pointwise import (ActType, activation, add, cast, div, eq, exp, ge, gelu, gelu_tanh, gt, le, lt, mul,
                        ne, neg, pow, relu, rsqrt, scalar, sigmoid, silu, sqrt, sub, tanh, where)
from .quant import quant_linear
from .reduction import argmax, layer_norm, max, mean, rms_norm, softmax, sum, topk

__all__ = [
    # pointwise
    "scalar", "add", "sub", "mul", "div", "neg", "exp", "rsqrt", "sqrt", "pow", "silu", "gelu", "gelu_tanh",
    "sigmoid", "tanh", "relu", "where", "cast", "lt", "le", "gt", "ge", "eq", "ne", "ActType", "activation",
    # reductions and row ops
    "sum", "mean", "max", "softmax", "argmax", "topk", "rms_norm", "layer_norm",
    # matmul
    "matmul", "bmm", "linear", "moe_experts", "quant_moe_experts", "lora_apply", "quant_linear",
    # views and data movement
    "reshape", "permute", "transpose", "unsqueeze", "squeeze", "slice", "expand", "split", "cat", "gather",
    "embedding", "getitem", "index_mask", "transfer",
    # attention
    "RopeLayout", "rope", "reshape_and_cache", "paged_attention", "paged_mla_attention",
    # collectives
    "all_reduce", "all_gather", "reduce_scatter",
]
