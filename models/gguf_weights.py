"""Keep a GGUF file's own blocks for a model's linears (``LLM(path.gguf, quantization="gguf")``).

:func:`keep_gguf_blocks` marks each attention/MLP projection (a
:class:`~graphdsl.layers.ColumnParallelLinear` / :class:`~graphdsl.layers.RowParallelLinear`, ``lm_head``
excepted) with the scheme ``gguf-<type>`` of the file tensors that fill it, so it stores one companion
``<weight>_packed`` (uint8 ``[out, stored_row_bytes]``, the file's block rows in the stored layout:
Q6_K's blocks padded to 224 bytes, :mod:`graphdsl.runtime.gguf_blocks`) and ``F.linear`` records
``quant_linear`` on it. The rule:

* a weight filled by one file tensor keeps that tensor's block type, if it is one of the types the
  GGUF kernels run (:data:`~graphdsl.runtime.gguf_blocks.KERNEL_QTYPES`);
* a packed weight (``qkv_proj`` from q/k/v, ``gate_up_proj`` from gate/up) whose parts all have one
  type keeps it; parts of different types (a Q4_K_M file's Q6_K ``attn_v`` beside Q4_K q/k) keep
  theirs side by side: :class:`~graphdsl.runtime.gguf_scheme.GGUFMixScheme`
  (``gguf-q4_k.5120+q6_k.1024``), one stored tensor and one kernel launch per run of rows of a type;
* an MoE expert stack (:class:`~graphdsl.layers.FusedExperts`' ``gate_up_proj``, ``down_proj``)
  whose experts' pieces all have one type keeps it (``gguf-<type>``: uint8 ``[experts, out,
  stored_row_bytes]``, run by :mod:`graphdsl.runtime.kernels.moe_gguf`); the two stacks of a layer
  keep their blocks together or not at all (gate/up Q4_K beside down Q6_K is kept; gate and up in
  different types, or one stack in a float type, leaves both dequantized);
* a weight with a part in a float type (F32/F16/BF16) or a type without a kernel, or packed by a
  reorder or a column slice, is dequantized to the model dtype, and one log line lists every weight
  that was; embeddings, norms and ``lm_head`` always are.

:func:`~graphdsl.models.loader.load_weights` then copies the block rows of the marked weights into
their ``_packed`` companions (``blocks=`` the returned names) and dequantizes everything else.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

from graphdsl.layers import ColumnParallelLinear, FusedExperts, RowParallelLinear
from graphdsl.runtime.gguf_blocks import KERNEL_QTYPES
from graphdsl.runtime.gguf_scheme import GGUFScheme, gguf_scheme

from .base import FlashCausalLM

__all__ = ["keep_gguf_blocks", "rows_of_slot"]

_log = logging.getLogger("graphdsl.gguf")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def rows_of_slot(slot) -> slice | None:
    """The row range ``slot`` fills when it fills whole rows (no reorder, no column slice, the whole
    checkpoint tensor); else None."""
    if slot.reorder is not None or slot.source != ():
        return None
    index = tuple(slot.index)
    if index == ():
        return slice(None)
    rows, *rest = index
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        return None
    if any(not (isinstance(r, slice) and r == slice(None)) for r in rest):
        return None
    return rows


def keep_gguf_blocks(model: FlashCausalLM, tensor_types: Mapping[str, str], *,
                     skip: tuple[str, ...] = ("lm_head",)) -> dict[str, str]:
    """Mark the linears of ``model`` whose file tensors can stay in their blocks (module docstring);
    return ``{parameter name: scheme name}`` of those. ``tensor_types``: ``{HF tensor name: GGML type}``
    of the file's matrices. The weights left dense are named in one log line (logger ``graphdsl.gguf``)."""
    dict(model.named_parameters())                                 # name every parameter first
    sources: dict[str, list] = {}
    for name, slot in model.checkpoint_table().items():
        sources.setdefault(slot.param, []).append((name, slot))
    types = {model.checkpoint_name(k): v for k, v in tensor_types.items()}
    kept, dense = {}, {}
    for _, m in model.named_modules():             # the expert stacks first: most of an MoE model's weights
        if isinstance(m, FusedExperts):
            _keep_stacks(m, sources, types, kept, dense)
    for path, m in model.named_modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)) or path in skip:
            continue
        p = m.weight
        parts = sources.get(p.name, [])
        found = {types.get(name) for name, _ in parts}
        why = None
        if not parts or None in found:
            why = "not a block matrix in the file"
        elif not found <= set(KERNEL_QTYPES):
            odd = sorted(found - set(KERNEL_QTYPES))
            why = ", ".join(f"{q} in the file" if q in _FLOAT_TYPES else f"{q}: no GGUF kernel" for q in odd)
        elif any(rows_of_slot(slot) is None or slot.shape[-1] != p.shape[1] for _, slot in parts):
            why = "packed by a reorder or a column slice"
        else:
            spans = sorted((rows_of_slot(slot).indices(p.shape[0])[:2], types[name]) for name, slot in parts)
            if [a for (a, _), _ in spans] != [0] + [b for (_, b), _ in spans[:-1]] or spans[-1][0][1] != p.shape[0]:
                why = "its parts do not tile its rows"
        if why is None:
            scheme = gguf_scheme([(q, b - a) for (a, b), q in spans])
            p.quantize(scheme)
            kept[p.name] = scheme.name
        else:
            dense[p.name] = why
    if dense:
        shown = ", ".join(f"{n} ({w})" for n, w in list(dense.items())[:4])
        more = f" and {len(dense) - 4} more" if len(dense) > 4 else ""
        _log.warning("quantization='gguf': %d of %d weights (linears, expert stacks) keep their GGUF blocks; %d are "
                     "dequantized: %s%s", len(kept), len(kept) + len(dense), len(dense), shown, more)
    _warn_dense_experts(model)
    return kept


def _expert_rows(slot) -> bool:
    """Whether ``slot`` fills whole rows of one expert of a stack (index ``(e, rows)`` or ``(e,)``)."""
    index = tuple(slot.index)
    if not index or not isinstance(index[0], int):
        return False
    return rows_of_slot(dataclasses.replace(slot, index=index[1:])) is not None


def _stack_type(p, parts: list, types: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(GGML type, None)`` when every expert piece of stack ``p`` is in one type with a kernel and
    fills whole rows, else ``(None, why not)``."""
    found = {types.get(name) for name, _ in parts}
    if not parts or None in found:
        return None, "not a block matrix in the file"
    if len(found) > 1:
        return None, f"its pieces are in different block types ({', '.join(sorted(found))})"
    (qtype,) = found
    if qtype not in KERNEL_QTYPES:
        return None, f"{qtype} in the file" if qtype in _FLOAT_TYPES else f"{qtype}: no GGUF kernel"
    if any(not _expert_rows(slot) or slot.shape[-1] != p.shape[2] for _, slot in parts):
        return None, "packed by a reorder or a column slice"
    return qtype, None


def _keep_stacks(m: FusedExperts, sources: dict, types: Mapping[str, str], kept: dict, dense: dict) -> None:
    """Mark both expert stacks of ``m`` ``gguf-<type>`` when both can keep their blocks and ``m``
    runs such stacks (:meth:`~graphdsl.layers.FusedExperts.takes_scheme`); else record why not."""
    stacks = (m.gate_up_proj, m.down_proj)
    found = [_stack_type(p, sources.get(p.name, []), types) for p in stacks]
    whys = [why or (None if m.takes_scheme(GGUFScheme(q)) else f"{type(m).__name__} runs {m.runs_schemes}")
            for q, why in found]
    for p, (qtype, _), why, other in zip(stacks, found, whys, reversed(whys)):
        if why is None and other is None:
            p.quantize(GGUFScheme(qtype))
            kept[p.name] = p.quant.name
        else:
            dense[p.name] = why or "its layer's other expert stack is dequantized"


def _warn_dense_experts(model: FlashCausalLM) -> None:
    """One warning when MoE expert stacks stay dequantized (their blocks could not be kept: the
    reasons are in the log line before): on an MoE model they are most of the weights."""
    from graphdsl.layers.quantize import dense_expert_share
    stacks, share = dense_expert_share(model)
    if not stacks:
        return
    _log.warning("quantization='gguf': %d MoE expert stacks (%.0f%% of the weights) are dequantized to the model "
                 "dtype; quantization='int4' (or 'int8', 'fp8') stores them quantized again instead "
                 "(docs/quantization.md)", stacks, 100 * share)
