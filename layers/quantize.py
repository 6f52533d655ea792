"""Online quantization of a module tree: mark its linear weights with a scheme, then turn loaded
full-precision weights into the scheme's stored tensors (the companions ``F.linear`` reads).

The projections of :mod:`graphdsl.layers.linear` (attention, MLP, and whatever else is built from
them) and the MoE expert stacks of :class:`~graphdsl.layers.FusedExperts` (each expert's weights in
the scheme, stacked; under tensor parallelism a rank's shards) are quantized; embeddings, norms, MoE
routers and shared-expert gates, stacks in a scheme their module does not run (``takes_scheme``:
fp8 for experts on the host) and, by default, ``lm_head`` stay in the model dtype.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Mapping

import torch

from graphdsl import Module
from graphdsl.errors import GraphDSLError
from graphdsl.quant import PERM_SUFFIX, IntScheme, QuantMethod, QuantScheme, online_scheme

from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import FusedExperts

__all__ = ["quantize_linears", "scheme_counts", "dense_expert_share", "quantize_weights", "fold_input_order",
           "FOLD_INPUT_ORDER", "store_codes_in_blocks", "bound_scheme", "INT4_BLOCKS", "GGUF_BLOCKS", "BLOCK_DEVICES"]

FOLD_INPUT_ORDER = True    # False: act-order down projections keep their gather (the A/B, and a reference)
INT4_BLOCKS = True         # False: a CUDA bind keeps int4 codes row by row (the A/B of FlashCausalLM.bind)
GGUF_BLOCKS = True         # False: a CUDA bind keeps GGUF blocks row by row (the same A/B)
BLOCK_DEVICES = ("cuda",)  # where a bind stores codes in blocks (store_codes_in_blocks' devices)


def quantize_linears(model: Module, scheme: QuantScheme | str, *, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Set ``scheme`` on every linear weight and MoE expert stack of ``model`` but the modules at
    paths in ``skip`` and those that keep their precision (``online_quantized`` false: MoE routers
    and gates; stacks under a scheme their module does not take, ``FusedExperts.takes_scheme``:
    fp8 with dynamic activation scales, fp8 on the host); return the quantized parameter names. The bare method
    ``"int4"`` takes groups of 128, or 64 / 32 for a weight whose input count 128 does not divide. A
    weight the scheme cannot hold (an input count not a multiple of the group) is an error naming it
    and the scheme."""
    adapt = scheme in (QuantMethod.INT4, QuantMethod.INT4.value)
    scheme = online_scheme(scheme)
    dict(model.named_parameters())                      # name every parameter first
    names = []
    for path, m in model.named_modules():
        if path in skip or not getattr(m, "online_quantized", False):
            continue
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            weights = [m.weight]
        elif isinstance(m, FusedExperts) and m.takes_scheme(scheme):
            weights = [m.gate_up_proj, m.down_proj]
        else:
            continue
        for w in weights:
            w.quantize(_int4_group(scheme, w) if adapt else scheme)
            names.append(w.name)
    return names


def scheme_counts(model: Module) -> str | None:
    """The schemes ``model``'s parameters are stored in, with counts, most common first
    (``"int4-g64 x90, int4-g128 x30"``); None when every parameter is full precision."""
    counts = collections.Counter(p.quant.name for _, p in model.named_parameters() if p.quant is not None)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common()) or None


def dense_expert_share(model: Module) -> tuple[int, float]:
    """``(count, share)`` of the MoE expert stacks (``[experts, ...]`` weights under ``.experts.``)
    left in full precision, and the fraction of all of ``model``'s weights they hold (for the
    warnings that say how much of an MoE model a quantization leaves dense)."""
    params = dict(model.named_parameters())
    dense = [p for n, p in params.items() if ".experts." in f".{n}" and p.quant is None and len(p.shape) == 3]
    total = sum(math.prod(p.shape) for p in params.values())
    return len(dense), sum(math.prod(p.shape) for p in dense) / max(total, 1)


def _int4_group(scheme: IntScheme, weight) -> IntScheme:
    """The bare ``int4`` method: groups of 128 where they divide the inputs (a weight's last dim),
    else the largest of 64 and 32 that does (SmolLM2's 576 inputs take 64); an error naming the
    weight when none does."""
    inputs = weight.shape[-1]
    for g in (128, 64, 32):
        if inputs % g == 0:
            return IntScheme(4, g, scheme.zero_point)
    raise GraphDSLError(f"quantization='int4': parameter {weight.name!r} has {inputs} inputs, which no int4 "
                        "group size (128, 64 or 32) divides; quantize this model with int8 or fp8")


def quantize_weights(model: Module, weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
                     progress: Callable[[int, int, str], None] | None = None) -> dict[str, torch.Tensor]:
    """``weights`` with each quantized parameter's full tensor replaced by its companions (scales in
    ``dtype``, default the weight's), quantized one parameter at a time so only one extra copy
    is alive at once. ``progress(done, total, name)`` is called after each parameter (the int4 and
    GGUF searches take minutes for a large model on a CPU)."""
    out = dict(weights)
    todo = [(name, p) for name, p in model.named_parameters() if p.quant is not None]
    for i, (name, p) in enumerate(todo, 1):
        w = out.pop(name, None)
        if w is None:
            raise GraphDSLError(f"quantize_weights: parameter {name!r} ({p.quant.name}) has no loaded tensor")
        if tuple(w.shape) != tuple(p.shape):
            raise GraphDSLError(f"quantize_weights: parameter {name!r} ({p.quant.name}) should be {list(p.shape)}, "
                                f"got {list(w.shape)}")
        stored = (p.quant.quantize_stack(w, dtype or w.dtype) if len(p.shape) == 3 else
                  p.quant.quantize(w, dtype or w.dtype))
        for c, t in zip(p.companions(), stored):
            out[c.name] = t
        del w
        if progress is not None:
            progress(i, len(todo), name)
    return out


def fold_input_order(producer: Module, consumer: Module, weights: dict, parts: int) -> torch.Tensor | None:
    """Fold an act-order ``consumer``'s input order into its ``producer``'s output rows.

    An act-order int4 weight (``int4-g{g}[-zp]-act``, GPTQ ``desc_act``) reads its inputs in the
    order ``perm``: ``F.linear`` gathers ``x[..., perm]`` first. When ``x`` is made row by row from
    ``parts`` equal blocks of the producer's output rows (a gated MLP: ``act(gate) * up``, row ``j``
    of gate paired with row ``j`` of up), the producer can store those rows already in that order:
    row ``j`` of each block becomes its row ``perm[j]``. The consumer then takes the plain scheme and
    no gather is recorded; the products are the same. ``weights`` (a bind's name -> tensor dict)
    gets new tensors (the producer's weight or its per-row companions, and its bias) and loses the
    consumer's ``_perm``; the two modules' Parameters change scheme where needed, and they record
    the orders (``row_order``, ``input_order``) for what adapts them later (LoRA). Returns ``perm``,
    or None when there is nothing to fold (not act-order, or ``weights`` folded already)."""
    w = consumer.weight
    perm = weights.get(f"{w.name}{PERM_SUFFIX}")
    folded = getattr(consumer, "input_order", None) is not None       # an earlier bind of these modules
    if perm is None or w.quant is None or not (w.quant.permutes_input or folded):
        return None
    p = producer.weight
    n = perm.shape[0]
    if tuple(p.shape)[0] != parts * n:
        raise GraphDSLError(f"fold_input_order: {p.name} has {p.shape[0]} rows, expected {parts} x {n} for "
                            f"{w.name}'s input order")
    rows = torch.cat([perm.long() + i * n for i in range(parts)])
    names = [p.name] if p.quant is None else [c.name for c, spec in zip(p.companions(),
                                                                         p.quant.companions(*tuple(p.shape)))
                                               if spec.per_row]
    bias = getattr(producer, "bias", None)
    names += [bias.name] if bias is not None else []
    for name in names:
        t = weights[name]
        weights[name] = t.index_select(0, rows.to(t.device))
    if w.quant.permutes_input:
        w.quantize(w.quant.kernel_scheme)
    del weights[f"{w.name}{PERM_SUFFIX}"]
    object.__setattr__(producer, "row_order", rows.cpu())
    object.__setattr__(consumer, "input_order", perm.long().cpu())
    return perm


def bound_scheme(scheme: QuantScheme) -> QuantScheme:
    """The scheme a bind on one of :data:`BLOCK_DEVICES` leaves a weight of ``scheme`` in: its codes
    in blocks along the inputs where it has that layout and the knob (:data:`INT4_BLOCKS`,
    :data:`GGUF_BLOCKS`) is on, else row by row."""
    return scheme.with_blocks(GGUF_BLOCKS if scheme.name.startswith("gguf-") else INT4_BLOCKS)


def store_codes_in_blocks(model: Module, weights: dict, devices: tuple[str, ...] = ("cuda",)) -> list[str]:
    """Store the codes of ``model``'s weights whose scheme has two layouts (int4, GGUF blocks) in
    ``weights`` (a bind's name -> tensor dict) in blocks along the inputs (``-kb`` schemes, block
    ``b`` of every row side by side: :func:`graphdsl.quant.int4_blocks`,
    :func:`graphdsl.runtime.gguf_blocks.block_major`) or row by row, as the knobs say
    (:data:`INT4_BLOCKS`, :data:`GGUF_BLOCKS`), switching each Parameter's scheme to match. Only
    codes on ``devices`` (types) change: the CPU reference would only unblock them again; elsewhere
    the scheme follows the codes' layout (blocked when the first companion is 3-D). In blocks,
    one step of a decode GEMV over many rows reads one contiguous piece of memory: on an H200 the
    Llama-3-8B int4 decode step took 1943 µs instead of 2068, the Q4_K_M mix's 2687 instead of 2918
    (docs/quantization-log.md). Returns the names of the parameters changed. A bind calls it last,
    after the hooks that reorder rows (:func:`fold_input_order`)."""
    changed = []
    for name, p in model.named_parameters():
        q = p.quant
        if q is None or len(p.shape) != 2 or q.with_blocks(True) == q.with_blocks(False):
            continue                                       # one layout (expert stacks: rows)
        names = [c.name for c in p.companions()]
        if any(n not in weights for n in names):
            continue
        tensors = [weights[n] for n in names]
        now = tensors[0].dim() == 3
        want = bound_scheme(q).blocked if tensors[0].device.type in devices else now
        if q.with_blocks(want) != q:
            p.quantize(q.with_blocks(want))
        if want != now:
            weights.update(zip(names, p.quant.in_layout(tensors, p.shape[1])))
            changed.append(name)
    return changed
