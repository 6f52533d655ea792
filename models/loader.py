"""Fill a model's parameters from checkpoint tensors through its checkpoint table.

One pass over ``(name, tensor)`` pairs (safetensors or GGUF, already in HF names): each tensor is
copied into its slot — a whole parameter, or a slice of a packed one (q/k/v → qkv, gate/up,
per-expert stacks). A tensor may be a lazy handle (``shape`` plus ``read(index)``, as
:func:`~graphdsl.runtime.loaders.safetensors.iter_safetensors_lazy` yields): then only the part the
slot holds (``slot.source``: a tensor-parallel rank's rows or columns) is read, and tensors that
match no slot are not read at all. Shapes are checked as tensors arrive, and at the end one
:class:`~graphdsl.GraphDSLError` lists every missing, unexpected and wrong-shape tensor.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Iterable

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.layers.linear import ColumnParallelLinear, RowParallelLinear
from graphdsl.layers.checkpoint import CheckpointSlot
from graphdsl.layers.moe import FusedExperts
from graphdsl.runtime.gguf_blocks import GGUFBlockWeight, to_stored
from graphdsl.runtime.loaders.safetensors import check_weights
from graphdsl.runtime.progress import ProgressLine

from .base import FlashCausalLM
from .gguf_weights import rows_of_slot

__all__ = ["load_weights", "mark_checkpoint_quantization", "wants_gguf_blocks", "online_quantization"]


def wants_gguf_blocks(quantization, not_gguf: str | None, prefix: str = "") -> bool:
    """Whether ``quantization`` is ``"gguf"`` (keep a GGUF file's blocks); an error (its message
    after ``prefix``) when the model (``not_gguf``: what it is) is not a GGUF file."""
    from graphdsl.quant import QuantMethod
    if quantization not in (QuantMethod.GGUF, QuantMethod.GGUF.value):
        return False
    if not_gguf is not None:
        raise GraphDSLError(f"{prefix}quantization='gguf' keeps the blocks of a GGUF file, but the model is "
                            f"{not_gguf!r}, not a .gguf file: load a .gguf file, or quantize online with a scheme "
                            "(fp8, int8, int4, gguf-q8_0, gguf-q4_k, ...)")
    return True


def online_quantization(quantization, stored, prefix: str = ""):
    """The online quantization to apply for ``LLM(..., quantization=)`` given the checkpoint's own
    (``stored``: its :class:`CheckpointQuantization`, None for a full-precision checkpoint):
    ``quantization`` itself over full precision; None over a pre-quantized checkpoint, where
    ``quantization`` may be unset or name the checkpoint's format as vLLM's does (``"awq"`` for an
    AutoAWQ checkpoint). Anything else is an error (its message after ``prefix``): an online scheme
    asked of a quantized checkpoint, another format's name, or a format's name over full precision."""
    from graphdsl.runtime.loaders.prequantized import STORED_METHODS
    if stored is None:
        if quantization in STORED_METHODS:
            raise GraphDSLError(f"{prefix}quantization={quantization!r} loads a checkpoint stored in that format, but "
                                "this one has no quantization_config in its config.json (full precision): leave "
                                "quantization unset, or quantize it online with fp8, int8, int4 or a scheme name")
        return quantization
    if quantization is None or quantization == stored.method:
        return None
    raise GraphDSLError(f"{prefix}quantization={quantization!r} given, but the checkpoint is already quantized "
                        f"({stored.method}, config.json's quantization_config): leave quantization unset or pass "
                        f"{stored.method!r}")


def mark_checkpoint_quantization(model: FlashCausalLM, quantization, checkpoint_names: Iterable[str] = ()) -> list[str]:
    """Give every linear weight and MoE expert stack of ``model`` the scheme a pre-quantized
    checkpoint stores it in (``quantization``: a
    :class:`~graphdsl.runtime.loaders.prequantized.CheckpointQuantization`); return the quantized
    parameter names. ``checkpoint_names``: the checkpoint's tensor names, so the config's module
    patterns match the modules as the checkpoint names them (Mixtral's ``block_sparse_moe.gate``
    is graphdsl's ``mlp.gate``). The checkpoint linears packed into one parameter (q/k/v into
    ``qkv_proj``, gate/up, every expert's pieces of a stack) must agree on the scheme, else an
    error names each piece's; a stack stored quantized must be one that holds codes (not run on the
    host) in a scheme stacks take. A linear whose weight the model holds in its dtype
    (``online_quantized`` false, e.g. MLA's ``kv_b_proj``, absorbed into the attention) keeps no
    scheme: its stored tensors are dequantized as they load (``quantization.dense``)."""
    for name in checkpoint_names:
        ours = model.checkpoint_name(name)
        if ours != name:
            quantization.originals[ours.rpartition(".")[0]] = name.rpartition(".")[0]
    table = model.checkpoint_table()
    dict(model.named_parameters())                      # name every parameter first
    linears = {m.weight.name: m for _, m in model.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    params = {name: m.weight for name, m in linears.items()}
    stacks = {p.name: m for _, m in model.named_modules() if isinstance(m, FusedExperts)
              for p in (m.gate_up_proj, m.down_proj)}
    params.update((p.name, p) for m in stacks.values() for p in (m.gate_up_proj, m.down_proj))
    pieces: dict[str, list[tuple[str, object]]] = {}
    for name, slot in table.items():
        if slot.param in params and name.endswith(".weight") and (slot.param.endswith(".weight") or slot.param in stacks):
            module = name[: -len(".weight")]
            pieces.setdefault(slot.param, []).append(
                (name, quantization.scheme_for(module, slot.shape[0], slot.shape[1])))
    names = []
    for param, got in pieces.items():
        schemes = {s.name if s is not None else "unquantized" for _, s in got}
        if len(schemes) > 1:
            each = ", ".join(f"{n}: {s.name if s is not None else 'unquantized'}" for n, s in got)
            raise GraphDSLError(f"parameter {param!r} packs checkpoint linears stored in different quantization schemes "
                                f"({each}); they must agree")
        scheme = got[0][1]
        if scheme is None:
            continue
        if param in stacks and not stacks[param].takes_scheme(scheme):
            raise GraphDSLError(f"the checkpoint stores the experts of {param!r} quantized ({scheme.name}), which "
                                f"{type(stacks[param]).__name__} does not run (it runs {stacks[param].runs_schemes})")
        if param in linears and not linears[param].online_quantized:    # held in the model dtype (MLA's kv_b_proj)
            quantization.dense.update(name[: -len(".weight")] for name, _ in got)
            continue
        params[param].quantize(scheme)
        names.append(param)
    return names


def _quantized_table(table: dict[str, CheckpointSlot], params: dict) -> dict[str, CheckpointSlot]:
    """``table`` with each piece of a quantized weight replaced by its companions' pieces: rows
    ``index`` of the weight are the same rows of every ``[out, ...]`` companion; a companion over
    the inputs (``per_row`` false: an act-order permutation) is filled whole by every piece, which
    must agree (``CheckpointSlot.shared``)."""
    out = {}
    for name, slot in table.items():
        p = params.get(slot.param)
        if p is None or p.quant is None:
            out[name] = slot
            continue
        index = slot.index[1:] if len(p.shape) == 3 and slot.index and isinstance(slot.index[0], int) else \
            slot.index                                  # an expert stack's piece: expert e, then its rows
        if slot.reorder is not None or slot.source or len(index) > 1 or (index and not isinstance(index[0], slice)):
            raise GraphDSLError(f"checkpoint tensor {name!r}: a quantized ({p.quant.name}) piece of {slot.param!r} must "
                                f"be whole rows, got index {slot.index}")
        rows, inputs = slot.shape
        for c_param, c in zip(p.companions(), p.quant.companions(rows, inputs)):
            out[f"{name}{c.suffix}"] = (CheckpointSlot(c_param.name, slot.index, c.shape) if c.per_row else
                                        CheckpointSlot(c_param.name, (), c.shape, shared=True))
    return out


def load_weights(model: FlashCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], *, device, dtype=None,
                 progress: bool = False, quantized: bool = False, blocks: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """``{parameter name: tensor on device}`` for every parameter of ``model`` (on the device
    :meth:`FlashCausalLM.parameter_devices` names, for parameters injected modules keep elsewhere).

    Args:
        tensors: checkpoint ``(name, tensor)`` pairs in HF naming (``model.checkpoint_renames`` apply).
        dtype: parameter dtype (default: the model's).
        progress: print a progress line on stderr while reading.
        quantized: the checkpoint holds the quantized weights' companions (``<name>_packed``,
            ``_scale``, ...; pieces of packed parameters too), not their full-precision tensors.
        blocks: parameters marked ``gguf-<type>`` (:func:`~graphdsl.models.gguf_weights.keep_gguf_blocks`)
            whose GGUF block rows (:class:`~graphdsl.runtime.gguf_blocks.GGUFBlockWeight` tensors) are
            copied into their ``_packed`` companion as they are (Q6_K's padded: gguf_blocks.to_stored). Any other block tensor is dequantized.
    """
    dtype = dtype or model.dtype
    table = model.checkpoint_table()
    params = dict(model.named_parameters())
    for p in params.values():          # bound on CUDA before (store_codes_in_blocks): checkpoints hold codes by rows
        if p.quant is not None and p.quant.blocked:
            p.quantize(p.quant.with_blocks(False))
    tied = model.tied_parameters()
    where = model.parameter_devices()
    if quantized:
        table = _quantized_table(table, params)
        for name, p in list(params.items()):
            if p.quant is not None:
                del params[name]
                params.update((c.name, c) for c in p.companions())
    blocks = set(blocks)
    out = {name: torch.zeros(tuple(p.shape), dtype=p.dtype or dtype, device=where.get(name, device))  # zeros: TP vocab padding
           for name, p in params.items() if name not in tied and name not in blocks}
    for name in blocks:
        for c in params[name].companions():
            out[c.name] = torch.zeros(tuple(c.shape), dtype=c.dtype, device=where.get(name, device))
    got: dict[str, tuple[int, ...]] = {}
    shared: dict[str, str] = {}          # shared parameter -> the checkpoint tensor that filled it first
    expected = {name: slot.shape for name, slot in table.items()}
    line = ProgressLine(sys.stderr) if progress else None
    for i, (name, tensor) in enumerate(tensors, 1):
        name = model.checkpoint_name(name)
        if model.is_ignored_checkpoint_name(name):
            continue
        got[name] = tuple(tensor.shape)
        slot = table.get(name)
        if isinstance(tensor, GGUFBlockWeight):
            if slot is not None and slot.param in blocks:
                _place_blocks(out, params[slot.param], name, slot, tensor)
                continue
            tensor = tensor.dequantize(dtype)
        elif slot is not None and slot.param in blocks:
            raise GraphDSLError(f"checkpoint tensor {name!r} is not in GGUF blocks, but {slot.param!r} "
                                f"({params[slot.param].quant.name}) keeps them")
        if slot is not None and tuple(tensor.shape) == slot.shape and slot.held:
            target = out[slot.param][slot.index]
            value = slot.place(_part(tensor, slot.source)).reshape(target.shape)
            if slot.shared:
                _check_shared(shared, slot.param, name, target, value)
            target.copy_(value)
        if line is not None and line.due():
            line.show(f"loading weights: {i} tensors ({len(got)}/{len(expected)} matched names)")
    if line is not None:
        line.done(f"loading weights: {len(got)} tensors")
    check_weights(expected, got)
    for name, source in tied.items():
        out[name] = out[source]
    return out


def _check_shared(first: dict[str, str], param: str, name: str, target: torch.Tensor, value: torch.Tensor) -> None:
    """A second checkpoint tensor filling the same whole ``param`` must hold the first one's values."""
    if param not in first:
        first[param] = name
    elif not torch.equal(target, value.to(target.device, target.dtype)):
        raise GraphDSLError(f"checkpoint tensors {first[param]!r} and {name!r} both fill {param!r} but differ: the "
                            "pieces of one fused linear must share one input order (GPTQ act-order g_idx)")


def _place_blocks(out: dict, p, name: str, slot, tensor: GGUFBlockWeight) -> None:
    """Copy the block rows of checkpoint tensor ``name`` into the rows ``slot`` names of ``p``'s
    stored part that holds them; a block type other than that part's is an error naming both."""
    if tuple(tensor.shape) != slot.shape or not slot.held:
        return                                             # a wrong shape is reported by check_weights
    stack = len(p.shape) == 3                              # an expert stack: slot.index is (expert, rows...)
    rows = rows_of_slot(dataclasses.replace(slot, index=slot.index[1:]) if stack else slot)
    n = p.shape[-2]
    a, b, _ = rows.indices(n)
    for c, (qtype, r0, r1) in zip(p.companions(), p.quant.row_parts(n)):
        if r0 <= a < r1:
            if tensor.qtype != qtype or b > r1:
                raise GraphDSLError(f"checkpoint tensor {name!r} is {tensor.qtype} rows {a}..{b}, but {p.name!r} "
                                    f"({p.quant.name}) keeps {qtype} blocks in rows {r0}..{r1}")
            target = out[c.name][slot.index[0]] if stack else out[c.name]
            target[a - r0:b - r0].copy_(to_stored(tensor.data, qtype))
            return


def _part(tensor, source: tuple) -> torch.Tensor:
    """``tensor[source]`` (all of it for ``()``), reading only that part of a lazy handle."""
    if isinstance(tensor, torch.Tensor):
        return tensor[source] if source else tensor
    return tensor.read(source)


