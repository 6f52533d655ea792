"""Sparse MoE experts over expert stacks kept in a GGUF file's own blocks (``gguf-<type>`` stacks).

A stack is uint8 ``codes [E, N, row_bytes]``: expert ``e``'s ``N`` weight rows, each its ``K``
inputs as consecutive GGML blocks in the stored layout (:mod:`graphdsl.runtime.gguf_blocks`; Q6_K's
padded to 224 bytes), the types of :data:`.gguf_tiles.KERNEL_QTYPES`. The math is
:func:`graphdsl.runtime.kernels.moe.quant_moe_experts`'s with ``W_e = dequant(codes[e])``:

    out[t] = Σ_j routing[t, e_j] · down_e · act(gate_e x[t], up_e x[t])

over each token's ``k`` largest routing weights. Both kernel families read the blocks through the
decoders the dense GGUF kernels use (:mod:`.gguf_tiles`), offset to the expert's rows:

* **few pairs** (decode; :func:`one_pair_by_default`): one (token, expert) pair a program row, as
  :mod:`.moe_gemv` — each program finds its pair's expert and weight in the routing row
  (``moe_gemv._choice``), then runs the one-row loop of :func:`.gguf_tiles.row_dot` over its
  ``BLOCK_N`` rows: gate/up with gate row ``c`` and up row ``I + c`` side by side in a tile, down
  with its K split into slices that :func:`.moe_gemv.finish` sums with the ``k`` choices (Q4_K and
  Q6_K stacks under fp16/bf16 activations take the same path on the int8 tensor cores instead:
  :mod:`.moe_gguf_mma`, unless ``MMA`` is off; so do stacks with a Q5_K or Q8_0 side, up to 8 pairs, through
  the dense rows kernel's K loop: :mod:`.moe_gguf_rows`);
* **more pairs** (prefill): the pairs grouped by expert (:func:`.moe.moe_align`), a block of
  ``BLOCK_M`` pairs times ``BLOCK_N`` rows a program, each K step ``SB`` blocks decoded into a
  float32 tile (:func:`.gguf_tiles.decode_tile`, values in tile order), the activations gathered at
  the tile's K offsets, one ``tl.dot`` in the activations' dtype; with ``PLANES`` (Q4_K, Q5_K,
  Q6_K and Q8_0 stacks, fp16/bf16 activations, unless ``MMA`` is off) a K step is one 32-value
  plane decoded in registers in K order instead (:func:`.moe_gguf_mma.rows_dot`: no spills, no
  gather).

Neither path writes a dequantized weight. File shape (STYLE.md 11): the four ``@triton.jit``
kernels, the launch choices, the launcher :func:`gguf_experts`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from . import gguf_linear   # its _FAST_PLANES switch: one for the dense and the expert plane loops
from .gguf_linear import _sb_for
from .gguf_tiles import KERNEL_QTYPES, decode_tile, row_codes, row_dot, row_total, row_zeros
from .moe_gemv import _act, _block_of_pairs, _choice, finish
from .moe_gguf_mma import eligible as mma_eligible
from .moe_gguf_mma import grouped_config as planes_config
from .moe_gguf_mma import mma_experts, planes_eligible, rows_dot
from .moe_gguf_rows import eligible as rows_eligible
from .moe_gguf_rows import rows_experts
from .paged_attention import _mm, _sm_count

__all__ = ["gguf_experts", "one_pair_by_default", "grouped_config", "MAX_PAIRS_PER_EXPERT", "MAX_PAIRS_PER_EXPERT_MMA",
           "MAX_PAIRS_PER_EXPERT_PLANES"]

# pairs an expert, on average, that the one-pair kernels take by default, by the gate/up stack's type (a pair
# reads its expert's blocks alone; the grouped kernels read a shared expert's blocks once a block of pairs). H200,
# Mixtral's experts (benchmarks/moe.py), µs one pair a row against grouped: Q4_K gate/up and Q6_K down at 8 pairs
# 681.5 vs 1655.1, 16 pairs 1313.2 vs 1759.7, 32 pairs 2586.8 vs 2458.3; Q8_0 at 8 pairs 932.0 vs 1087.8, 16 pairs
# 1818.9 vs 1149.3. The other 32-value types are taken as Q8_0, Q5_K as Q4_K (not timed).
# the .moe_gguf_mma kernels where they take the stacks (one pair a row on the int8 tensor cores; grouped, a plane of
# weights at a time dequantized in registers); False: the CUDA-core loop and the float32 tile kernels below
MMA = True
MAX_PAIRS_PER_EXPERT = {"Q4_K": 2, "Q5_K": 2, "Q6_K": 2, "Q4_0": 1, "Q4_1": 1, "Q5_0": 1, "Q5_1": 1, "Q8_0": 1}
# ... and where both paths run .moe_gguf_mma's kernels. H200, Mixtral's experts, Q4_K gate/up and Q6_K down, µs one
# pair a row against grouped: 8 pairs 319.2 vs 1284.6, 16 pairs 603.9 vs 1287.3, 32 pairs 1113.4 vs 1396.4, 64
# pairs 2158.2 vs 1505.3
MAX_PAIRS_PER_EXPERT_MMA = 4
# ... and where only the grouped kernels run them (a plane at a time: .moe_gguf_mma.planes_eligible, e.g. Q5_K gate/up
# and Q6_K down, Q8_0). H200, Mixtral's experts, bf16, µs one pair a row (CUDA cores) against grouped planes: Q5_K /
# Q6_K 2 pairs 223.7 vs 752.0, 16 pairs 1589.1 vs 1477.2; Q8_0 16 pairs 1825.9 vs 1515.1. Up to moe_gguf_rows.MAX_PAIRS
# (8) pairs the one-pair path runs on the int8 tensor cores (moe_gguf_rows; 1 token 143.3 against 537.6 grouped, 4
# tokens 471.6 against 1054.6)
MAX_PAIRS_PER_EXPERT_PLANES = 1


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, sx,                 # tokens [T, H] (inner stride 1), row stride
    w_ptr, swe, row_bytes,     # gate_up blocks [E, 2I, row_bytes] uint8: expert stride, bytes a row
    h_ptr,                     # out: act(gate)·up per pair [P, I], contiguous
    r_ptr, sr, E,              # routing [T, E] (inner stride 1), row stride, experts (moe_gemv._choice)
    H, I, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    QTYPE: tl.constexpr, VALUES: tl.constexpr, SB: tl.constexpr, BYTES: tl.constexpr, GEGLU: tl.constexpr,
):
    """``h[p, c] = act(gate_e[c] · x[t], up_e[c] · x[t])`` for ``BLOCK_N / 2`` columns ``c``: the tile's
    rows are gate row ``c`` and up row ``I + c`` in turn."""
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e, _ = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    r = tl.arange(0, BLOCK_N)
    c = pid_n * (BLOCK_N // 2) + r // 2
    ok = c < I
    rows = w_ptr + e * swe + (c + (r % 2) * I).to(tl.int64) * row_bytes
    x_row = x_ptr + (p // TOP_K).to(tl.int64) * sx
    acc = row_zeros(BLOCK_N, QTYPE, SB)
    for s in range(0, H // (VALUES * SB)):
        b0, b1 = row_codes(rows, ok, s * SB, BYTES, QTYPE, SB)
        acc = row_dot(acc, b0, b1, rows, ok, s * SB, BYTES, x_row, QTYPE, SB)
    g, u = tl.split(tl.reshape(row_total(acc), [BLOCK_N // 2, 2]))
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(h_ptr + p.to(tl.int64) * I + cols, _act(g, u, GEGLU).to(h_ptr.dtype.element_ty), mask=cols < I)


@triton.jit
def _pair_down_kernel(
    h_ptr,                     # act(gate)·up per pair [P, I], contiguous
    w_ptr, swe, row_bytes,     # down blocks [E, H, row_bytes] uint8
    y_ptr,                     # out: each K slice's weighted partial per pair [S, P, H], float32
    r_ptr, sr, E,              # routing [T, E]
    P, H, I, SLICE,            # SLICE: SB-block steps a K slice
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    QTYPE: tl.constexpr, VALUES: tl.constexpr, SB: tl.constexpr, BYTES: tl.constexpr,
):
    """``y[s, p, n] = weight(p) · Σ_{k in slice s} h[p, k] · down_e[n, k]``."""
    p, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e, wt = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < H
    rows = w_ptr + e * swe + n.to(tl.int64) * row_bytes
    h_row = h_ptr + p.to(tl.int64) * I
    acc = row_zeros(BLOCK_N, QTYPE, SB)
    s_lo = pid_k * SLICE
    for s in range(s_lo, tl.minimum(s_lo + SLICE, I // (VALUES * SB))):
        b0, b1 = row_codes(rows, ok, s * SB, BYTES, QTYPE, SB)
        acc = row_dot(acc, b0, b1, rows, ok, s * SB, BYTES, h_row, QTYPE, SB)
    tl.store(y_ptr + (pid_k * P + p).to(tl.int64) * H + n, row_total(acc) * wt, mask=ok)


@triton.jit
def _tile_dot(acc, a_rows, a_ok, w_rows, w_ok, blk0, BYTES: tl.constexpr, QTYPE: tl.constexpr,
              VALUES: tl.constexpr, SB: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc + A[:, K step] @ dequant(W)[rows, K step]ᵀ`` for the ``SB`` blocks from ``blk0``: the
    weight tile decoded (values in tile order, :func:`.gguf_tiles.decode_tile`), the activations
    ``a_rows`` (``[BLOCK_M]`` row pointers) gathered at the same K offsets."""
    w, koff = decode_tile(w_rows, w_ok, blk0, BYTES, QTYPE, SB)              # [BLOCK_N, SB·VALUES]
    a = tl.load(a_rows[:, None] + (blk0 * VALUES + koff)[None, :], mask=a_ok[:, None], other=0.0)
    return acc + _mm(a, tl.trans(w.to(a.dtype)), DOT_PREC, DOT_F32)


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, sx,                 # tokens [T, H] (inner stride 1), row stride
    w_ptr, swe, row_bytes,     # gate_up blocks [E, 2I, row_bytes] uint8
    h_ptr,                     # out: act(gate)·up per pair [P, I], contiguous
    rows_ptr, blk_e_ptr,       # moe_align: pair index per padded row, expert per block
    P, H, I, E, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QTYPE: tl.constexpr, VALUES: tl.constexpr, SB: tl.constexpr,
    BYTES: tl.constexpr, GEGLU: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    PLANES: tl.constexpr = False,   # a 32-value plane a K step (.moe_gguf_mma.rows_dot; its PLANE_QTYPES)
    FAST: tl.constexpr = False,     # PLANES: Q4_K / Q6_K planes decoded by packed PTX (rows_dot's FAST)
):
    """h[p, n] = act(x[p // k] · gate_e[n], x[p // k] · up_e[n]) for the pairs of block ``b``."""
    e, pairs, valid, n, n_ok = _block_of_pairs(rows_ptr, blk_e_ptr, P, I, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    x_rows = x_ptr + tl.where(valid, pairs // TOP_K, 0).to(tl.int64) * sx
    if PLANES:                             # the planes' loads carry no mask: rows past I read row I - 1
        gate = w_ptr + e.to(tl.int64) * swe + tl.minimum(n, I - 1).to(tl.int64) * row_bytes
        up = gate + I.to(tl.int64) * row_bytes
        acc_g = rows_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_rows, valid, gate, H, QTYPE, BYTES,
                         DOT_PREC, DOT_F32, FAST)
        acc_u = rows_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_rows, valid, up, H, QTYPE, BYTES,
                         DOT_PREC, DOT_F32, FAST)
    else:
        gate = w_ptr + e.to(tl.int64) * swe + n.to(tl.int64) * row_bytes
        up = w_ptr + e.to(tl.int64) * swe + (n + I).to(tl.int64) * row_bytes
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, H // (VALUES * SB)):
            wg, koff = decode_tile(gate, n_ok, s * SB, BYTES, QTYPE, SB)     # gate and up: one tile order
            wu, _ = decode_tile(up, n_ok, s * SB, BYTES, QTYPE, SB)
            a = tl.load(x_rows[:, None] + (s * SB * VALUES + koff)[None, :], mask=valid[:, None], other=0.0)
            acc_g += _mm(a, tl.trans(wg.to(a.dtype)), DOT_PREC, DOT_F32)
            acc_u += _mm(a, tl.trans(wu.to(a.dtype)), DOT_PREC, DOT_F32)
    h = _act(acc_g, acc_u, GEGLU)
    tl.store(h_ptr + pairs[:, None].to(tl.int64) * I + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _grouped_down_kernel(
    h_ptr,                     # act(gate)·up per pair [P, I], contiguous
    w_ptr, swe, row_bytes,     # down blocks [E, H, row_bytes] uint8
    wt_ptr,                    # routing weight per pair [P], float32
    y_ptr,                     # out: weighted expert outputs per pair [P, H], float32
    rows_ptr, blk_e_ptr,
    P, H, I, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QTYPE: tl.constexpr, VALUES: tl.constexpr, SB: tl.constexpr,
    BYTES: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, PLANES: tl.constexpr = False,
    FAST: tl.constexpr = False,
):
    """y[p, n] = weight(p) · h[p] · down_e[n] for the pairs of block ``b``."""
    e, pairs, valid, n, n_ok = _block_of_pairs(rows_ptr, blk_e_ptr, P, H, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    safe = tl.where(valid, pairs, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PLANES:
        rows = w_ptr + e.to(tl.int64) * swe + tl.minimum(n, H - 1).to(tl.int64) * row_bytes
        acc = rows_dot(acc, h_ptr + safe * I, valid, rows, I, QTYPE, BYTES, DOT_PREC, DOT_F32, FAST)
    else:
        rows = w_ptr + e.to(tl.int64) * swe + n.to(tl.int64) * row_bytes
        for s in range(0, I // (VALUES * SB)):
            acc = _tile_dot(acc, h_ptr + safe * I, valid, rows, n_ok, s * SB, BYTES, QTYPE, VALUES, SB, DOT_PREC,
                            DOT_F32)
    wt = tl.load(wt_ptr + safe, mask=valid, other=0.0)
    tl.store(y_ptr + safe[:, None] * H + n[None, :], acc * wt[:, None], mask=valid[:, None] & n_ok[None, :])


_PAIR_VALUES = 512        # values a one-pair step (the dense one-row GGUF GEMV's: gguf_linear._pick_config)
_PAIR_ROWS = 8            # rows a one-pair program (ditto)
_PAIR_PROGRAMS_PER_SM = 4  # down's K is split until its grid gives every SM this many programs


def grouped_config(pairs: int):
    """The tile kernels' launch, a ``moe.MoeConfig`` whose per-kernel tuples are ``(BLOCK_N, values a
    K step, num_warps, num_stages)``: 16 pairs a block and 32-row tiles for decode-sized counts; 64
    pairs a block and 64-row tiles beyond (the H200 sweep of ``benchmarks/moe.py --sweep`` at
    Mixtral's size, 512 tokens, Q4_K gate/up and Q6_K down: 22764 µs with 32-row tiles, 12374 with
    these)."""
    from .moe import MoeConfig
    if pairs <= 64:
        return MoeConfig(16, (32, 256, 4, 2), (32, 256, 4, 2))
    return MoeConfig(64, (64, 256, 4, 2), (64, 256, 4, 1))


def one_pair_by_default(up, down, pairs: int, experts: int, dtype: torch.dtype) -> bool:
    """Whether ``pairs`` (token, expert) pairs over the GGUF stacks ``up`` and ``down``
    (``moe._Stack``) of ``experts`` experts, under ``dtype`` activations, take the one-pair kernels
    by default: at most :data:`MAX_PAIRS_PER_EXPERT_MMA` an expert on average where they run on
    the tensor cores (:func:`.moe_gguf_mma.eligible`), :data:`MAX_PAIRS_PER_EXPERT_PLANES` where
    only the grouped ones run a plane at a time (:func:`.moe_gguf_mma.planes_eligible`), else
    :data:`MAX_PAIRS_PER_EXPERT` for the gate/up stack's type."""
    hidden, inter = down.codes.shape[1], up.codes.shape[1] // 2
    if MMA and mma_eligible(up, down, hidden, inter, dtype):
        return pairs <= MAX_PAIRS_PER_EXPERT_MMA * experts
    if MMA and planes_eligible(up, down, hidden, inter, dtype):
        return pairs <= MAX_PAIRS_PER_EXPERT_PLANES * experts
    return pairs <= MAX_PAIRS_PER_EXPERT[up.qtype] * experts


def gguf_experts(x: torch.Tensor, routing: torch.Tensor, up, down, inter: int, top_k: int, geglu: bool,
                 interp: bool, out: torch.Tensor, gemv: bool, config=None) -> torch.Tensor:
    """``out [T, H]`` (``x``'s dtype) over the GGUF stacks ``up`` (``[E, 2I, ...]``) and ``down``
    (``[E, H, ...]``), given as ``moe._Stack`` (``codes``, ``qtype``): one pair a program row
    (``gemv``) or grouped by expert (module docstring). ``config``: the grouped kernels' launch
    (:func:`grouped_config`; :func:`.moe_gguf_mma.grouped_config` where those kernels run)."""
    from .moe import choices, moe_align
    t, hidden = x.shape
    e = routing.shape[1]
    pairs = t * top_k
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)

    def blocks(stack, k: int, values: int) -> dict:
        """The launch's stack arguments: ``SB`` blocks a step, at most ``values`` values, dividing the row."""
        codes, per = stack.codes, KERNEL_QTYPES[stack.qtype][0]
        return dict(w_ptr=codes, swe=codes.stride(0), row_bytes=codes.stride(1), QTYPE=stack.qtype,
                    VALUES=per, SB=_sb_for(k // per, max(1, values // per)),
                    BYTES=KERNEL_QTYPES[stack.qtype][1])

    if gemv and MMA and mma_eligible(up, down, hidden, inter, x.dtype):
        return mma_experts(x, routing, up, down, inter, top_k, geglu, out)
    if gemv and MMA and rows_eligible(up, down, hidden, inter, x.dtype, t, top_k):
        return rows_experts(x, routing, up, down, inter, top_k, geglu, out)
    if gemv:
        route = dict(r_ptr=routing, sr=routing.stride(0), E=e, TOP_K=top_k, E_PAD=triton.next_power_of_2(e))
        warps = dict(num_warps=2, num_stages=1)
        _pair_gate_up_kernel[(pairs, triton.cdiv(2 * inter, _PAIR_ROWS))](
            x, x.stride(0), h_ptr=h, H=hidden, I=inter, BLOCK_N=_PAIR_ROWS, GEGLU=geglu,
            **blocks(up, hidden, _PAIR_VALUES), **route, **warps)
        dn = blocks(down, inter, _PAIR_VALUES)
        steps = inter // (dn["VALUES"] * dn["SB"])
        tiles = triton.cdiv(hidden, _PAIR_ROWS)
        split = max(1, min(steps, _PAIR_PROGRAMS_PER_SM * _sm_count(x.device) // (pairs * tiles)))
        slice_steps = triton.cdiv(steps, split)
        split = triton.cdiv(steps, slice_steps)                  # no empty slices
        y = torch.empty((split, pairs, hidden), dtype=torch.float32, device=x.device)
        _pair_down_kernel[(pairs, tiles, split)](
            h, y_ptr=y, P=pairs, H=hidden, I=inter, SLICE=slice_steps, BLOCK_N=_PAIR_ROWS, **dn, **route, **warps)
        return finish(y, out, top_k)
    planes = MMA and planes_eligible(up, down, hidden, inter, x.dtype)
    cfg = config or (planes_config(pairs) if planes else grouped_config(pairs))
    for name, kcfg in (("up", cfg.up), ("down", cfg.down)):
        if planes and kcfg[1] != 32:
            raise GraphDSLError(f"gguf_experts: {up.qtype} / {down.qtype} stacks step one 32-value plane, so "
                                f"config.{name} must take 32 values a K step, got {kcfg}")
    weights, ids = choices(routing, top_k)
    rows, block_expert = moe_align(ids, e, cfg.block_m)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    common = dict(BLOCK_M=cfg.block_m, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", DOT_F32=interp,
                  PLANES=planes, FAST=planes and not interp and gguf_linear._FAST_PLANES)

    def launch(kcfg, stack, k: int) -> dict:
        bn, values, warps, stages = kcfg
        return dict(BLOCK_N=bn, num_warps=warps, num_stages=1 if interp else stages, **blocks(stack, k, values),
                    **common)

    num_blocks = block_expert.numel()
    _grouped_gate_up_kernel[(num_blocks, triton.cdiv(inter, cfg.up[0]))](
        x, x.stride(0), h_ptr=h, rows_ptr=rows, blk_e_ptr=block_expert, P=pairs, H=hidden, I=inter, E=e,
        TOP_K=top_k, GEGLU=geglu, **launch(cfg.up, up, hidden))
    _grouped_down_kernel[(num_blocks, triton.cdiv(hidden, cfg.down[0]))](
        h, wt_ptr=weights.reshape(-1).contiguous(), y_ptr=y, rows_ptr=rows, blk_e_ptr=block_expert, P=pairs,
        H=hidden, I=inter, E=e, **launch(cfg.down, down, inter))
    return finish(y.view(1, pairs, hidden), out, top_k)
