"""One launch for the inputs a decode step computes from its positions (the CUDA-graph prologue).

For row ``r`` with position ``p = positions[r]``, context ``L = seq_lens[r]`` and frequencies
``inv [half]`` (:meth:`graphdsl.layers.rotary.RotaryEmbedding.inv_freq`, with its cos/sin factor
``scale``)::

    cos[r, i] = cos(float(p) * inv[i]) * scale          sin[r, i] = sin(float(p) * inv[i]) * scale
    slot[r]   = block_tables[r, clamp(p // bs, 0, width - 1)] * bs + p % bs    if L > 0, else -1

— what :meth:`~graphdsl.layers.rotary.RotaryEmbedding.cos_sin` and
:func:`graphdsl.runtime.serving.kv_cache.decode_slots` compute with a dozen torch kernels (a
product, ``cos``, ``sin``, a division, a clamp, a gather, casts, a ``where``), each a launch gap in
the replayed step. ``float(p) * inv[i]`` is one float32 product and ``cos``/``sin`` are libdevice's
``cosf``/``sinf`` (CUDA's math library, which torch's kernels call too), so the tables are the bits
the torch path makes; under the CPU interpreter they are numpy's (within an ulp).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from graphdsl.errors import GraphDSLError

__all__ = ["decode_step_inputs"]

_BLOCK_ROWS = 16


@triton.jit
def _step_inputs_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, bt_ptr, lens_ptr, slot_ptr, R, HALF, width, stride_bt,
                        scale, block_size, ROPE: tl.constexpr, SLOTS: tl.constexpr, SCALED: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Rows ``[pid * BLOCK_R, (pid + 1) * BLOCK_R)``: their cos/sin rows (``ROPE``) and cache slots
    (``SLOTS``), as the module docstring states. ``LIBDEVICE``: compiled (``tl.cos`` may lower to
    ``cos.approx``, far off at the angles of long contexts); the interpreter has ``tl.cos`` only."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    p = tl.load(pos_ptr + r, mask=r_ok, other=0).to(tl.int64)
    if ROPE:
        i = tl.arange(0, BLOCK_H)
        i_ok = i < HALF
        inv = tl.load(inv_ptr + i, mask=i_ok, other=0.0)
        f = p.to(tl.float32)[:, None] * inv[None, :]
        if LIBDEVICE:
            c = libdevice.cos(f)
            s = libdevice.sin(f)
        else:
            c = tl.cos(f)
            s = tl.sin(f)
        if SCALED:
            c = c * scale
            s = s * scale
        at = r[:, None] * HALF + i[None, :]
        ok = r_ok[:, None] & i_ok[None, :]
        tl.store(cos_ptr + at, c, mask=ok)
        tl.store(sin_ptr + at, s, mask=ok)
    if SLOTS:
        col = tl.minimum(tl.maximum(p // block_size, 0), width - 1)
        block = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + col, mask=r_ok, other=0).to(tl.int64)
        live = tl.load(lens_ptr + r, mask=r_ok, other=0) > 0
        slot = tl.where(live, block * block_size + p % block_size, -1)
        tl.store(slot_ptr + r, slot.to(slot_ptr.dtype.element_ty), mask=r_ok)


def _check_rows(name: str, t: torch.Tensor, rows: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != rows or t.dtype.is_floating_point:
        raise GraphDSLError(f"decode_step_inputs: {name} must be an integer tensor [{rows}], got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                            f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
    if t.device != device:
        raise GraphDSLError(f"decode_step_inputs: {name} must be on {device} (positions' device), got {t.device}")


def decode_step_inputs(positions: torch.Tensor, *, inv_freq: torch.Tensor | None = None, scale: float = 1.0,
                       block_tables: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                       block_size: int | None = None) -> dict:
    """The prologue's tensors in one launch: with ``inv_freq`` (float32 ``[half]``) ``cos`` and
    ``sin`` (float32 ``[rows, half]``); with ``block_tables`` (``[rows, width]``), ``seq_lens`` and
    ``block_size`` the ``slot_mapping`` (``positions``' dtype, ``[rows]``). ``positions``: integer
    ``[rows]``. Module docstring: the math."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.dtype.is_floating_point:
        raise GraphDSLError(f"decode_step_inputs: positions must be an integer tensor [rows], got "
                            f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    rope, slots = inv_freq is not None, block_tables is not None
    if not (rope or slots):
        raise GraphDSLError("decode_step_inputs: give inv_freq (RoPE tables), block_tables (cache slots) or both")
    rows, dev = positions.shape[0], positions.device
    positions = positions.contiguous()          # (a no-op on the graph runner's static buffers)
    out = {}
    half, inv = 1, positions
    if rope:
        if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.device != dev:
            raise GraphDSLError(f"decode_step_inputs: inv_freq must be float32 [half] on {dev}, got "
                                f"{tuple(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}")
        half, inv = inv_freq.shape[0], inv_freq
        out["cos"] = torch.empty(rows, half, device=dev, dtype=torch.float32)
        out["sin"] = torch.empty(rows, half, device=dev, dtype=torch.float32)
    bt, lens, slot, width, stride_bt, bs = positions, positions, positions, 1, 0, 1
    if slots:
        if seq_lens is None or block_size is None or int(block_size) < 1:
            raise GraphDSLError(f"decode_step_inputs: block_tables needs seq_lens and a block_size >= 1, got "
                                f"seq_lens={'None' if seq_lens is None else tuple(seq_lens.shape)}, block_size={block_size}")
        if block_tables.dim() != 2 or block_tables.shape[0] != rows or block_tables.dtype.is_floating_point:
            raise GraphDSLError(f"decode_step_inputs: block_tables must be an integer tensor [{rows}, width], got "
                                f"{tuple(block_tables.shape)} {block_tables.dtype}")
        _check_rows("seq_lens", seq_lens, rows, dev)
        if block_tables.device != dev:
            raise GraphDSLError(f"decode_step_inputs: block_tables must be on {dev} (positions' device), got "
                                f"{block_tables.device}")
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        bt, lens, width, stride_bt, bs = (block_tables, seq_lens.contiguous(), block_tables.shape[1],
                                          block_tables.stride(0), int(block_size))
        slot = out["slot_mapping"] = torch.empty_like(positions)
    if rows:                                    # (unused pointers: any tensor of the device)
        _step_inputs_kernel[(triton.cdiv(rows, _BLOCK_ROWS),)](
            positions, inv, out.get("cos", inv), out.get("sin", inv), bt, lens, slot, rows, half, width, stride_bt,
            float(scale), bs,
            ROPE=rope, SLOTS=slots, SCALED=scale != 1.0, BLOCK_R=_BLOCK_ROWS, BLOCK_H=triton.next_power_of_2(half),
            LIBDEVICE=type(_step_inputs_kernel).__name__ != "InterpretedFunction")
    return out
