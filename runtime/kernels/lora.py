"""LoRA over a per-token adapter index: Triton shrink kernels (BGMV for a few rows, slot-tiled for many).

The LoRA term of token ``t`` is ``(x[t]·A[s]ᵀ)·B[:, s]ᵀ`` with ``s = indices[t]`` (``s < 0``: no
adapter), ``A [S, R, K]``, ``B [N, S, R]`` (scaling folded into B). Two shrinks compute
``x·A[s]ᵀ``, each in one launch:

* :func:`lora_shrink` (**few rows**, ``T <= MAX_BGMV_ROWS``: decode) — the "batched gather
  matrix-vector" shrink of Punica/vLLM's BGMV: program ``(t, k-slice)`` reduces ``x[t]`` against
  its own adapter's ``A[s]`` over one ``LORA_SPLIT_K`` slice of K and writes ``R`` float32 partial
  sums ``p [T, splits, R]`` (split-K: a batch-1 shrink of a 14336-wide input spreads over 56
  programs instead of one streaming 460 KB). Rows without an adapter write nothing. On Hopper it
  launches with PDL (:mod:`.pdl`), so its launch overlaps the previous kernel's tail; with
  ``inputs_ready`` (slots and A are step constants) each program also reads its slot and its A
  slice before the wait, leaving only ``x``'s slice and the reduction on the critical path.
* :func:`lora_shrink_dense` (**many rows**: prefill, large decode batches) — the slot-dense
  ``V [T, S·R]`` in x's dtype: ``V[t, s·R + r] = x[t]·A[s, r]`` for the token's own slot and 0 in
  every other slot's columns (all of them for base rows), so ``V·B_allᵀ`` (``B`` is
  output-major: ``B_all = B.view(N, S·R)``) is every row's own term in one cuBLAS GEMM. Program
  ``(row block, slot, K slice)`` multiplies its rows by ``A[s]`` with ``tl.dot`` (loading only
  the rows of slot ``s``) and masks the others; a block none of whose rows uses ``s`` only writes
  zeros (a prefill of one adapter reads one slot's A). Few tiles (a batch-64 decode step over 8
  slots is 8) split K within the launch, the GEMV's way (:func:`_dense_splits`). The wasted work is the other slots' rows inside a used block — small next to the
  base GEMM. (A segmented GEMM over tokens grouped by adapter, Punica's SGMV, avoids even that.)

The expand half is not a kernel of its own where it matters:

* the fused projections ``matmul_lora`` / ``matmul_add_lora`` / ``matmul_silu_mul_lora``
  (``passes/fused_ops.py``) add ``Σ_r v[t, r]·B[n, s, r]`` (``v`` = the partials summed over
  splits) inside the decode GEMV's float32 accumulator, before its bias/residual or SwiGLU
  epilogue (:mod:`.gemv`, ``HAS_LORA``); with many rows the product runs on cuBLAS and one
  ``addmm`` adds ``V·B_allᵀ`` into it before ``silu_mul`` / with the residual;
* the un-fused op :func:`lora_apply` (graphs no fusion rule matched) keeps an expand kernel for a
  few rows (``_expand_kernel``: ``out[t] = y[t] + B[:, s]·v[t]``) and the ``addmm`` for many.

File shape (STYLE.md 11): the ``@triton.jit`` kernels, the launch heuristics :func:`_blocks` /
:func:`_dense_blocks`, :func:`lora_supported` and the public wrappers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.functional.lora import LORA_SPLIT_K

from ..device import triton_interprets
from .pdl import pdl_launch, pdl_trigger, pdl_wait

__all__ = ["lora_apply", "lora_shrink", "lora_shrink_dense", "lora_dense_view", "lora_splits", "lora_supported",
           "silu_mul_lora", "block_r_of", "MAX_RANK", "MAX_BGMV_ROWS"]

MAX_RANK = 256          # slot width (parts · rank) the kernels take
MAX_BGMV_ROWS = 16      # rows up to which the per-token kernels run (beyond: slot-dense GEMMs)
MAX_ROW_PROGRAMS = 4096  # (row, K slice) programs up to which the slot-dense V comes from per-row programs
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _shrink_kernel(x_ptr,        # [T, K] activations, row stride stride_x, unit inner stride
                   a_ptr,        # [S, R, K] contiguous A factors of every slot
                   idx_ptr,      # [T] int slot of each token (< 0: none)
                   p_ptr,        # [T, SPLITS, R] float32 out: partial sums of x[t] · A[s]ᵀ per K slice
                   v_ptr,        # [T, S·R] out (x's dtype), row stride stride_v (DENSE)
                   lock_ptr,     # [T] int32 arrival counters, zero between launches (DENSE)
                   K, R, S, SPLITS, stride_x, stride_v,
                   SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_PDL: tl.constexpr,       # launched with programmatic dependent launch
                   LATE_LAUNCH: tl.constexpr,   # let the next kernel launch at the end, not after the wait
                   PREFETCH: tl.constexpr,      # idx and A are step constants and BLOCK_K == SPLIT_K:
                                                # read the slot and the A slice before the PDL wait
                   DENSE: tl.constexpr,         # the last slice of a row to arrive writes its V row
                   SPLITS_P2: tl.constexpr, BLOCK_W: tl.constexpr):   # (DENSE) tile of the sum, of a V row
    """p[t, j, r] = Σ_{k in slice j} x[t, k] · A[s, r, k]; rows without an adapter write nothing.

    ``DENSE`` (:func:`lora_shrink_dense` for decode batches): each slice then bumps its row's
    counter; the last of the row's slices to arrive sums the row's partials in slice order (one
    ``[SPLITS, R]`` load, so the result does not depend on arrival order), writes the slot-dense
    ``V[t] = (0, .., x[t]·A[s]ᵀ, .., 0)`` and resets the counter; a base row's slice 0 writes zeros."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    out = p_ptr + (t.to(tl.int64) * SPLITS + j) * R + r
    if PREFETCH:
        s = tl.load(idx_ptr + t).to(tl.int64)
        k = j * SPLIT_K + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + s * R * K + r[:, None].to(tl.int64) * K + k[None, :],
                    mask=(r_ok & ((r * 0 + s) >= 0))[:, None] & (k < K)[None, :], other=0.0)
        pdl_wait(USE_PDL, not LATE_LAUNCH)
        if s >= 0:
            xk = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            tl.store(out, tl.sum(a.to(tl.float32) * xk[None, :], axis=1), mask=r_ok)
            if DENSE:
                _dense_row(p_ptr, v_ptr, lock_ptr, t, j, s, R, S, SPLITS, stride_v, BLOCK_R, SPLITS_P2, BLOCK_W)
        elif DENSE and j == 0:
            _dense_row(p_ptr, v_ptr, lock_ptr, t, j, s, R, S, SPLITS, stride_v, BLOCK_R, SPLITS_P2, BLOCK_W)
    else:
        pdl_wait(USE_PDL, not LATE_LAUNCH)
        s = tl.load(idx_ptr + t).to(tl.int64)
        if s >= 0:
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            a_row = a_ptr + s * R * K + r[:, None].to(tl.int64) * K
            for k0 in range(j * SPLIT_K, j * SPLIT_K + SPLIT_K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
                ak = tl.load(a_row + k[None, :], mask=r_ok[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
                acc += tl.sum(ak * xk[None, :], axis=1)
            tl.store(out, acc, mask=r_ok)
            if DENSE:
                _dense_row(p_ptr, v_ptr, lock_ptr, t, j, s, R, S, SPLITS, stride_v, BLOCK_R, SPLITS_P2, BLOCK_W)
        elif DENSE and j == 0:
            _dense_row(p_ptr, v_ptr, lock_ptr, t, j, s, R, S, SPLITS, stride_v, BLOCK_R, SPLITS_P2, BLOCK_W)
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)


@triton.jit
def _dense_row(p_ptr, v_ptr, lock_ptr, t, j, s, R, S, SPLITS, stride_v,
               BLOCK_R: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_W: tl.constexpr):
    """Row ``t``'s slot-dense V row once all its slices stored their partials (``s < 0``: zeros,
    written by slice 0 without counting). Called after the program stored its own partial."""
    r = tl.arange(0, BLOCK_R)
    v = tl.zeros((BLOCK_R,), dtype=tl.float32)
    last = s < 0
    if s >= 0:
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + t, 1, sem="acq_rel")
        last = arrived == SPLITS - 1
        if last:
            jj = tl.arange(0, SPLITS_P2)
            part = tl.load(p_ptr + (t.to(tl.int64) * SPLITS + jj[:, None]) * R + r[None, :],
                           mask=(jj < SPLITS)[:, None] & (r < R)[None, :], other=0.0, cache_modifier=".cg")
            v = tl.sum(part, axis=0)
            tl.atomic_xchg(lock_ptr + t, 0, sem="relaxed")     # read again only by a later launch
    if last:
        row = v_ptr + t.to(tl.int64) * stride_v
        for c0 in range(0, S * R, BLOCK_W):
            c = c0 + tl.arange(0, BLOCK_W)
            tl.store(row + c, tl.zeros((BLOCK_W,), tl.float32).to(v_ptr.dtype.element_ty),
                     mask=(c < S * R) & ((c // R) != s))
        if s >= 0:
            tl.store(row + s * R + r, v.to(v_ptr.dtype.element_ty), mask=r < R)


@triton.jit
def _expand_kernel(p_ptr,        # [T, SPLITS, R] float32 partials from the shrink
                   b_ptr,        # [N, S, R] contiguous B factors (scaling folded in)
                   idx_ptr,      # [T] int slot of each token (< 0: none)
                   y_ptr,        # [T, N] base output, row stride stride_y
                   out_ptr,      # [T, N] out = y + B[:, s] · v, row stride stride_o
                   N, S, R, SPLITS, stride_y, stride_o,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """v[t] = Σ_j p[t, j]; out[t, n] = y[t, n] + Σ_r v[t, r] · B[n, s, r] (out[t] = y[t] when s < 0)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(idx_ptr + t).to(tl.int64)
    y = tl.load(y_ptr + t.to(tl.int64) * stride_y + n, mask=n < N, other=0.0)
    acc = y.to(tl.float32)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        v = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for j in range(0, SPLITS):
            v += tl.load(p_ptr + (t.to(tl.int64) * SPLITS + j) * R + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + n[:, None].to(tl.int64) * S * R + s * R + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * v[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _shrink_dense_kernel(x_ptr,      # [T, K] activations, row stride stride_x, unit inner stride
                         a_ptr,      # [S, R, K] contiguous A factors of every slot
                         idx_ptr,    # [T] int slot of each token (< 0: none)
                         v_ptr,      # [T, S·R] out (x's dtype), row stride stride_v
                         part_ptr,   # [SPLITS, n_tiles, BLOCK_T, BLOCK_R] float32 partial tiles (SPLIT)
                         lock_ptr,   # [n_tiles] int32 arrival counters, zero between launches (SPLIT)
                         T, K, R, K_SPLIT, SPLITS, stride_x, stride_v,
                         BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr,         # SPLITS > 1
                         DOT_F32: tl.constexpr,       # multiply in float32 (fp32 inputs; the interpreter)
                         IEEE: tl.constexpr):         # fp32 inputs: full-precision dot, not tf32
    """V[t, s·R + r] = Σ_k x[t, k] · A[s, r, k] if indices[t] == s else 0, for the block's rows and
    slot ``s = program_id(1)``, over K slice ``program_id(2)``; float32 accumulation, stored in V's
    dtype. With ``SPLIT`` the slices meet as the GEMV's do: each stores its partial tile and bumps
    the tile's counter, the last to arrive sums the partials in slice order, stores and resets the
    counter. A tile none of whose rows uses ``s`` is zeros: slice 0 writes them, nobody counts."""
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    pid_k = tl.program_id(2)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rt < T
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    own = (tl.load(idx_ptr + rt, mask=t_ok, other=-1) == s) & t_ok
    out = v_ptr + rt.to(tl.int64)[:, None] * stride_v + s * R + r[None, :]
    o_ok = t_ok[:, None] & r_ok[None, :]
    if tl.sum(own.to(tl.int32), axis=0) > 0:
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        x_rows = x_ptr + rt.to(tl.int64)[:, None] * stride_x
        a_rows = a_ptr + (s * R + r).to(tl.int64)[:, None] * K
        k_lo = pid_k * K_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_rows + k[None, :], mask=own[:, None] & (k < K)[None, :], other=0.0)
            ak = tl.load(a_rows + k[None, :], mask=r_ok[:, None] & (k < K)[None, :], other=0.0)
            if DOT_F32:
                if IEEE:
                    acc += tl.dot(xk.to(tl.float32), tl.trans(ak.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(xk.to(tl.float32), tl.trans(ak.to(tl.float32)))
            else:
                acc += tl.dot(xk, tl.trans(ak))
        if SPLIT:
            n_tiles = tl.num_programs(0) * tl.num_programs(1)
            tile = pid_t * tl.num_programs(1) + s
            rb = tl.arange(0, BLOCK_T)
            part = part_ptr + rb[:, None] * BLOCK_R + r[None, :]
            tl.store(part + (pid_k * n_tiles + tile).to(tl.int64) * (BLOCK_T * BLOCK_R), acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
                for j in range(0, SPLITS):
                    acc += tl.load(part + (j * n_tiles + tile).to(tl.int64) * (BLOCK_T * BLOCK_R), cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed")     # read again only by a later launch
                tl.store(out, tl.where(own[:, None], acc, 0.0).to(v_ptr.dtype.element_ty), mask=o_ok)
        else:
            tl.store(out, tl.where(own[:, None], acc, 0.0).to(v_ptr.dtype.element_ty), mask=o_ok)
    elif pid_k == 0:
        tl.store(out, tl.zeros([BLOCK_T, BLOCK_R], tl.float32).to(v_ptr.dtype.element_ty), mask=o_ok)


@triton.jit
def _silu_mul_lora_kernel(p_ptr,      # [T, 2I] base product (gate | up), x's dtype, row stride stride_p
                          v_ptr,      # [T, W] slot-dense V (W = S·R), row stride stride_v
                          b_ptr,      # [2I, W] B of every slot, output-major, contiguous
                          out_ptr,    # [T, I] out, row stride stride_o
                          T, I, W, stride_p, stride_v, stride_o,
                          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                          ONE_STEP: tl.constexpr,     # W <= BLOCK_W: B's tiles are read before the PDL wait
                          DOT_F32: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    """``g = p[t, n] + V[t]·B[n]``, ``u = p[t, I + n] + V[t]·B[I + n]`` (float32, the LoRA term
    never rounded to the product's dtype), ``out[t, n] = silu(g) · u`` for the block's rows and
    ``n`` in the block's columns. No kernel of a step writes B, so with ``ONE_STEP`` its tiles are
    loaded before the wait for the kernels that write ``p`` and ``V``."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = rt < T
    n_ok = rn < I
    ok = t_ok[:, None] & n_ok[None, :]
    c = tl.arange(0, BLOCK_W)
    b_gate = b_ptr + rn.to(tl.int64)[:, None] * W + c[None, :]
    b_up = b_ptr + (rn + I).to(tl.int64)[:, None] * W + c[None, :]
    v_rows = v_ptr + rt.to(tl.int64)[:, None] * stride_v + c[None, :]
    p_rows = p_ptr + rt.to(tl.int64)[:, None] * stride_p + rn[None, :]
    if ONE_STEP:
        bg = tl.load(b_gate, mask=n_ok[:, None] & (c < W)[None, :], other=0.0)
        bu = tl.load(b_up, mask=n_ok[:, None] & (c < W)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    g = tl.load(p_rows, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(p_rows + I, mask=ok, other=0.0).to(tl.float32)
    for c0 in range(0, W, BLOCK_W):
        c_ok = (c0 + c) < W
        v = tl.load(v_rows + c0, mask=t_ok[:, None] & c_ok[None, :], other=0.0)
        if not ONE_STEP:
            bg = tl.load(b_gate + c0, mask=n_ok[:, None] & c_ok[None, :], other=0.0)
            bu = tl.load(b_up + c0, mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
            if IEEE:
                g += tl.dot(v, tl.trans(bg.to(tl.float32)), input_precision="ieee")
                u += tl.dot(v, tl.trans(bu.to(tl.float32)), input_precision="ieee")
            else:
                g += tl.dot(v, tl.trans(bg.to(tl.float32)))
                u += tl.dot(v, tl.trans(bu.to(tl.float32)))
        else:
            g += tl.dot(v, tl.trans(bg))
            u += tl.dot(v, tl.trans(bu))
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_o + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def _blocks(rank: int, interpreted: bool) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_K, BLOCK_N)``: the slot width padded to a power of two (>= 16); K and N tiles
    of about 8K float32 products a program (1K under the interpreter); BLOCK_K divides LORA_SPLIT_K."""
    block_r = block_r_of(rank)
    budget = 1024 if interpreted else 8192
    tile = max(16, min(256, budget // block_r))
    return block_r, min(tile, LORA_SPLIT_K), tile


def _dense_blocks(rows: int, rank: int, interpreted: bool) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_R, BLOCK_K)`` of the slot-dense shrink: 64-row blocks (16 for few rows or
    under the interpreter), the slot width padded to a power of two (>= 16), 64-wide K steps (32 for
    slots wider than 64, to bound the A tile's registers)."""
    block_t = 16 if interpreted or rows <= 16 else 64
    block_r = block_r_of(rank)
    return block_t, block_r, 32 if block_r > 64 or interpreted else 64


def lora_supported(y, x, a, b, indices) -> str | None:
    """Why the kernels cannot take this call (None: they can). ``y`` is the base product (or any
    tensor of its dtype and inner stride)."""
    if x.dtype not in _DTYPES or a.dtype != x.dtype or b.dtype != x.dtype or y.dtype != x.dtype:
        return f"dtypes x {x.dtype}, a {a.dtype}, b {b.dtype}, y {y.dtype}"
    if a.shape[1] > MAX_RANK:
        return f"slot width {a.shape[1]} > {MAX_RANK}"
    if not (a.is_contiguous() and b.is_contiguous() and indices.is_contiguous()):
        return "non-contiguous factors or indices"
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        return "non-unit inner strides"
    return None


def lora_splits(k: int) -> int:
    """K slices of :func:`lora_shrink` for ``k`` input features."""
    return triton.cdiv(k, LORA_SPLIT_K)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor, partials: torch.Tensor, *,
                inputs_ready: bool = False) -> torch.Tensor:
    """One launch: ``partials[t, j] = x[t, slice j]·A[indices[t], :, slice j]ᵀ`` (float32, ``partials``
    holds at least ``T · splits · R`` values, read as ``[T, splits, R]``); rows with ``indices[t] < 0``
    are left as they were (readers skip them). Returns the ``[T, splits, R]`` view.

    ``inputs_ready``: no kernel of the step writes ``indices`` or ``a`` (the backend's
    ``step_constant``), so under PDL each program reads its slot and its A slice (slots up to 64
    wide: one ``[R, LORA_SPLIT_K]`` tile) before waiting for the kernel that writes ``x``."""
    t, k = x.shape
    _, r, _ = a.shape
    splits = lora_splits(k)
    if partials.dtype != torch.float32 or partials.numel() < t * splits * r:
        raise GraphDSLError(f"lora_shrink: partials must be float32 with at least {t * splits * r} values, got "
                            f"{partials.numel()} {partials.dtype}")
    view = partials.view(-1)[:t * splits * r].view(t, splits, r)
    if t == 0:
        return view
    _launch_shrink(x, a, indices, view, inputs_ready=inputs_ready)
    return view


def _launch_shrink(x, a, indices, partials, *, inputs_ready: bool, v=None, lock=None) -> None:
    """The BGMV shrink over ``(t, k-slice)`` programs into ``partials [T, splits, R]``; with ``v``
    and ``lock`` (``[T]`` zeroed int32 counters) also the slot-dense ``V`` rows (``DENSE``)."""
    from .gemv import _num_sms
    t, k = x.shape
    slots, r, _ = a.shape
    splits = lora_splits(k)
    block_r, block_k, _ = _blocks(r, triton_interprets())
    prefetch = inputs_ready and block_r <= 64
    if prefetch:
        block_k = LORA_SPLIT_K
    dense = v is not None
    _shrink_kernel[(t, splits)](
        x, a, indices, partials, v if dense else partials, lock if dense else indices, k, r, slots, splits,
        x.stride(0), v.stride(0) if dense else 0, SPLIT_K=LORA_SPLIT_K, BLOCK_R=block_r, BLOCK_K=block_k,
        LATE_LAUNCH=t * splits > _num_sms(x.device), PREFETCH=prefetch, DENSE=dense,
        SPLITS_P2=triton.next_power_of_2(splits), BLOCK_W=min(1024, triton.next_power_of_2(slots * r)),
        num_warps=8 if prefetch and block_r > 32 else 4, **pdl_launch(x.device))


def _dense_splits(tiles: int, k: int, block_k: int, sms: int) -> int:
    """K slices of the slot-dense shrink: enough that ``tiles · slices`` covers the SMs twice (a
    batch-64 step over 8 slots is 8 tiles: alone they would stream 400 KB of A each on 8 SMs), of
    at least 4 ``BLOCK_K`` steps; 1 once the tiles fill the machine (prefill)."""
    splits = 1
    while tiles * splits < 2 * sms and triton.cdiv(k, splits * 2) >= 4 * block_k:
        splits *= 2
    return splits


def lora_shrink_dense(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, *,
                      scratch: dict | None = None, inputs_ready: bool = False,
                      by_rows: bool | None = None) -> torch.Tensor:
    """One launch: the slot-dense ``V [T, S·R]`` (module docstring) into ``out`` (x's dtype, unit
    inner stride, ``[T, S·R]``): each row's own slot's ``x[t]·A[s]ᵀ``, zeros elsewhere. ``scratch``
    (a dict the caller keeps, e.g. the backend's workspaces) holds the split-K partials and zeroed
    counters per shape, made on first use (a captured CUDA graph keeps their addresses).

    ``by_rows`` (default: up to ``MAX_ROW_PROGRAMS`` ``(row, K slice)`` programs, a decode batch)
    runs the BGMV shrink's programs, whose last slice per row writes the V row (``DENSE``; with
    ``inputs_ready`` the A slice is read before the PDL wait, as :func:`lora_shrink`'s). Otherwise
    row-block tiles (``tl.dot`` over 64-row blocks: A is read once per block, not once per row; the
    last split reads its partial tiles one after another). H200, 8 slots of rank 16, µs after a
    cuBLAS GEMM in a CUDA graph, rows / tiles: 64 rows of 4096 inputs 3.9-5.4 / 7.4-7.7, of 14336
    8.5 / 11.7; 128 rows of 14336 16.0 / 13.5; 256 rows of 4096 6.1 / 5.5."""
    t, k = x.shape
    slots, r, _ = a.shape
    if tuple(out.shape) != (t, slots * r) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise GraphDSLError(f"lora_shrink_dense: out must be [{t}, {slots * r}] {x.dtype} with a unit inner stride, "
                            f"got {list(out.shape)} {out.dtype} strides {out.stride()}")
    if t == 0:
        return out
    scratch = {} if scratch is None else scratch
    splits = lora_splits(k)
    if (t * splits <= MAX_ROW_PROGRAMS) if by_rows is None else by_rows:
        key = ("lora_rows", str(x.device), t, splits * r)
        if key not in scratch:
            scratch[key] = (torch.empty(t * splits * r, dtype=torch.float32, device=x.device),
                            torch.zeros(t, dtype=torch.int32, device=x.device))
        part, lock = scratch[key]
        _launch_shrink(x, a, indices, part, inputs_ready=inputs_ready, v=out, lock=lock)
        return out
    from .gemv import _num_sms
    block_t, block_r, block_k = _dense_blocks(t, r, triton_interprets())
    t_blocks = triton.cdiv(t, block_t)
    splits = _dense_splits(t_blocks * slots, k, block_k, _num_sms(x.device))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)
    part = lock = out
    if splits > 1:
        key = ("lora_dense", str(x.device), t_blocks * slots, splits, block_t, block_r)
        if key not in scratch:
            scratch[key] = (torch.empty(splits * t_blocks * slots * block_t * block_r, dtype=torch.float32,
                                        device=x.device),
                            torch.zeros(t_blocks * slots, dtype=torch.int32, device=x.device))
        part, lock = scratch[key]
    f32 = x.dtype == torch.float32
    _shrink_dense_kernel[(t_blocks, slots, splits)](
        x, a, indices, out, part, lock, t, k, r, k_split, splits, x.stride(0), out.stride(0), BLOCK_T=block_t,
        BLOCK_R=block_r, BLOCK_K=block_k, SPLIT=splits > 1,
        DOT_F32=f32 or (triton_interprets() and x.dtype == torch.bfloat16), IEEE=f32, num_warps=4)
    return out


def lora_dense_view(workspace: torch.Tensor, t: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[t, width]`` matrix of ``dtype`` at the start of a float32 ``workspace``."""
    return workspace.view(-1).view(dtype)[:t * width].view(t, width)


def silu_mul_lora(prod: torch.Tensor, v: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One launch: the SwiGLU of a gate/up product with each row's LoRA term added first,
    ``out = silu(g) · u`` where ``[g | u] = prod + V·B_allᵀ`` (``V`` from :func:`lora_shrink_dense`,
    ``B_all = b.view(2I, S·R)``). Replaces the ``addmm`` + ``silu_mul`` pair of a many-row
    ``matmul_silu_mul_lora``; the term is added in float32, not rounded to ``prod``'s dtype first."""
    t, n2 = prod.shape
    width = v.shape[1]
    if b.shape[0] != n2 or b[0].numel() != width or not b.is_contiguous() or n2 % 2 \
            or tuple(out.shape) != (t, n2 // 2) or prod.stride(-1) != 1 or v.stride(-1) != 1 or out.stride(-1) != 1:
        raise GraphDSLError(f"silu_mul_lora: prod [T, 2I] {list(prod.shape)}, V [T, S·R] {list(v.shape)}, "
                            f"B [2I, S, R] {list(b.shape)} and out [T, I] {list(out.shape)} do not fit "
                            "(unit inner strides, B contiguous)")
    if t == 0:
        return out
    interp = triton_interprets()
    block_t = 16 if interp or t <= 16 else (32 if t <= 32 else 64)
    block_n = 32
    block_w = 32 if interp else min(128, max(16, triton.next_power_of_2(width)))
    f32 = prod.dtype == torch.float32
    _silu_mul_lora_kernel[(triton.cdiv(t, block_t), triton.cdiv(n2 // 2, block_n))](
        prod, v, b, out, t, n2 // 2, width, prod.stride(0), v.stride(0), out.stride(0), BLOCK_T=block_t,
        BLOCK_N=block_n, BLOCK_W=block_w, ONE_STEP=width <= block_w,
        DOT_F32=f32 or (interp and prod.dtype == torch.bfloat16), IEEE=f32, num_warps=4, **pdl_launch(prod.device))
    return out


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, indices: torch.Tensor, *,
               out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
               dense: bool | None = None, scratch: dict | None = None) -> torch.Tensor:
    """``out = y + (x·A[idx]ᵀ)·B[:, idx]ᵀ`` per token (module docstring); ``out`` may be ``y`` itself
    (in place). ``workspace``: float32 scratch of at least ``T·R·max(splits, S)`` values (the op's
    workspace rule; allocated when omitted). ``dense`` forces the path (default: slot-dense above
    ``MAX_BGMV_ROWS`` rows): two launches either way (shrink + expand, or the slot-dense shrink +
    one cuBLAS ``addmm``). ``scratch``: as :func:`lora_shrink_dense`'s."""
    why = lora_supported(y, x, a, b, indices)
    if why is not None:
        raise GraphDSLError(f"lora_apply kernel: unsupported operands: {why}")
    t, k = x.shape
    slots, r, _ = a.shape
    n = b.shape[0]
    out = torch.empty_like(y) if out is None else out
    if t == 0:
        return out
    splits = lora_splits(k)
    need = t * r * max(splits, slots)
    if workspace is None or workspace.numel() < need:
        workspace = torch.empty(need, dtype=torch.float32, device=x.device)
    dense = t > MAX_BGMV_ROWS if dense is None else dense
    if dense:
        v = lora_shrink_dense(x, a, indices, lora_dense_view(workspace, t, slots * r, x.dtype), scratch=scratch)
        torch.addmm(y, v, b.view(n, slots * r).T, out=out)
        return out
    p = lora_shrink(x, a, indices, workspace)
    _, _, block_n = _blocks(r, triton_interprets())
    _expand_kernel[(t, triton.cdiv(n, block_n))](p, b, indices, y, out, n, slots, r, splits, y.stride(0),
                                                 out.stride(0), BLOCK_N=block_n, BLOCK_R=block_r_of(r))
    return out


def block_r_of(rank: int) -> int:
    """The slot width padded to a power of two (>= 16): ``BLOCK_R`` of every kernel here and of the
    GEMV's LoRA epilogue."""
    return max(16, triton.next_power_of_2(rank))
