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
  ``(row block, slot)`` multiplies its rows by ``A[s]`` with ``tl.dot`` and masks the rows of other
  slots; a block none of whose rows uses ``s`` only writes zeros (a prefill of one adapter reads one
  slot's A). The wasted work is the other slots' rows inside a used block — small next to the
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

import os

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.functional.lora import LORA_SPLIT_K

from .pdl import pdl_launch, pdl_trigger, pdl_wait

__all__ = ["lora_apply", "lora_shrink", "lora_shrink_dense", "lora_dense_view", "lora_splits", "lora_supported",
           "block_r_of", "MAX_RANK", "MAX_BGMV_ROWS"]

MAX_RANK = 256          # slot width (parts · rank) the kernels take
MAX_BGMV_ROWS = 16      # rows up to which the per-token kernels run (beyond: slot-dense GEMMs)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _shrink_kernel(x_ptr,        # [T, K] activations, row stride stride_x, unit inner stride
                   a_ptr,        # [S, R, K] contiguous A factors of every slot
                   idx_ptr,      # [T] int slot of each token (< 0: none)
                   p_ptr,        # [T, SPLITS, R] float32 out: partial sums of x[t] · A[s]ᵀ per K slice
                   K, R, SPLITS, stride_x,
                   SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_PDL: tl.constexpr,       # launched with programmatic dependent launch
                   LATE_LAUNCH: tl.constexpr,   # let the next kernel launch at the end, not after the wait
                   PREFETCH: tl.constexpr):     # idx and A are step constants and BLOCK_K == SPLIT_K:
                                                # read the slot and the A slice before the PDL wait
    """p[t, j, r] = Σ_{k in slice j} x[t, k] · A[s, r, k]; rows without an adapter write nothing."""
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
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)


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
                         T, K, R, stride_x, stride_v,
                         BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_F32: tl.constexpr,       # multiply in float32 (fp32 inputs; the interpreter)
                         IEEE: tl.constexpr):         # fp32 inputs: full-precision dot, not tf32
    """V[t, s·R + r] = Σ_k x[t, k] · A[s, r, k] if indices[t] == s else 0, for the block's rows and
    slot ``s = program_id(1)``; float32 accumulation, stored in V's dtype."""
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rt < T
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    own = (tl.load(idx_ptr + rt, mask=t_ok, other=-1) == s) & t_ok
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    if tl.sum(own.to(tl.int32), axis=0) > 0:
        x_rows = x_ptr + rt.to(tl.int64)[:, None] * stride_x
        a_rows = a_ptr + (s * R + r).to(tl.int64)[:, None] * K
        for k0 in range(0, K, BLOCK_K):
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
        acc = tl.where(own[:, None], acc, 0.0)
    out = v_ptr + rt.to(tl.int64)[:, None] * stride_v + s * R + r[None, :]
    tl.store(out, acc.to(v_ptr.dtype.element_ty), mask=t_ok[:, None] & r_ok[None, :])


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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    from .gemv import _num_sms
    block_r, block_k, _ = _blocks(r, _interpreting())
    prefetch = inputs_ready and block_r <= 64
    if prefetch:
        block_k = LORA_SPLIT_K
    _shrink_kernel[(t, splits)](x, a, indices, view, k, r, splits, x.stride(0), SPLIT_K=LORA_SPLIT_K,
                                BLOCK_R=block_r, BLOCK_K=block_k, LATE_LAUNCH=t * splits > _num_sms(x.device),
                                PREFETCH=prefetch, num_warps=8 if prefetch and block_r > 32 else 4,
                                **pdl_launch(x.device))
    return view


def lora_shrink_dense(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One launch: the slot-dense ``V [T, S·R]`` (module docstring) into ``out`` (x's dtype, unit
    inner stride, ``[T, S·R]``): each row's own slot's ``x[t]·A[s]ᵀ``, zeros elsewhere."""
    t, k = x.shape
    slots, r, _ = a.shape
    if tuple(out.shape) != (t, slots * r) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise GraphDSLError(f"lora_shrink_dense: out must be [{t}, {slots * r}] {x.dtype} with a unit inner stride, "
                            f"got {list(out.shape)} {out.dtype} strides {out.stride()}")
    if t == 0:
        return out
    block_t, block_r, block_k = _dense_blocks(t, r, _interpreting())
    f32 = x.dtype == torch.float32
    _shrink_dense_kernel[(triton.cdiv(t, block_t), slots)](
        x, a, indices, out, t, k, r, x.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_F32=f32 or (_interpreting() and x.dtype == torch.bfloat16), IEEE=f32, num_warps=4)
    return out


def lora_dense_view(workspace: torch.Tensor, t: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[t, width]`` matrix of ``dtype`` at the start of a float32 ``workspace``."""
    return workspace.view(-1).view(dtype)[:t * width].view(t, width)


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, indices: torch.Tensor, *,
               out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
               dense: bool | None = None) -> torch.Tensor:
    """``out = y + (x·A[idx]ᵀ)·B[:, idx]ᵀ`` per token (module docstring); ``out`` may be ``y`` itself
    (in place). ``workspace``: float32 scratch of at least ``T·R·max(splits, S)`` values (the op's
    workspace rule; allocated when omitted). ``dense`` forces the path (default: slot-dense above
    ``MAX_BGMV_ROWS`` rows): two launches either way (shrink + expand, or the slot-dense shrink +
    one cuBLAS ``addmm``)."""
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
        v = lora_shrink_dense(x, a, indices, lora_dense_view(workspace, t, slots * r, x.dtype))
        torch.addmm(y, v, b.view(n, slots * r).T, out=out)
        return out
    p = lora_shrink(x, a, indices, workspace)
    _, _, block_n = _blocks(r, _interpreting())
    _expand_kernel[(t, triton.cdiv(n, block_n))](p, b, indices, y, out, n, slots, r, splits, y.stride(0),
                                                 out.stride(0), BLOCK_N=block_n, BLOCK_R=block_r_of(r))
    return out


def block_r_of(rank: int) -> int:
    """The slot width padded to a power of two (>= 16): ``BLOCK_R`` of every kernel here and of the
    GEMV's LoRA epilogue."""
    return max(16, triton.next_power_of_2(rank))
