"""Sparse MoE experts: only the experts each token chose are computed (grouped GEMMs over sorted rows).

``moe_experts(x [T, H], routing [T, E], gate_up [E, 2I, H], down [E, H, I])`` is

    out[t] = Σ_e routing[t, e] · down_e · act(gate_e x[t], up_e x[t])

where ``routing`` holds each token's top-k expert weights and zeros elsewhere. Only the top-k are
computed, so decode reads ``k / E`` of the expert weights instead of all of them.

1. **Align** (:func:`moe_align`, on the device, no host sync, so it is CUDA-graph safe: one Triton
   program for up to 128 pairs, torch ops beyond): the ``P = T·k`` (token, choice) pairs are
   grouped by expert, each group padded to a multiple of ``BLOCK_M``:
   ``rows[b·BLOCK_M + i]`` is a pair index (``P`` marks padding) and ``block_expert[b]`` the expert
   of block ``b`` (``E`` past the last block: such programs exit). At most
   ``cdiv(P, BLOCK_M) + min(E, P)`` blocks are needed, a bound fixed by the shapes.
2. **Gate/up** (:func:`_gate_up_kernel`): program ``(b, n)`` multiplies its block's gathered token
   rows by expert ``e``'s gate and up rows ``n·BLOCK_N ...``, float32 accumulation, and stores
   ``act(gate) · up`` (SwiGLU or tanh-GeGLU) for each pair: ``h [P, I]`` in the input dtype.
3. **Down** (:func:`_down_kernel`): ``y[p] = routing weight(p) · h[p] @ down_eᵀ`` in float32.
4. ``out = Σ_k y.view(T, k, H)``, cast to the input dtype (``moe_gemv.finish``: one launch).

The pairs come from each token's ``k`` largest routing weights (:mod:`.row_topk` on the device,
one launch).

**Quantized stacks** (:func:`quant_moe_experts`; weight-only schemes, ``QuantScheme.stackable``):
the same two kernels read each weight tile as codes (the activations are the dot's other operand):

* per channel (``int8-channel``, ``fp8-channel``): the codes are exact in the operands' dtype,
  ``acc = Σ_k a_k · q[n, k]``, then ``acc · s[n]`` after the K loop;
* int4 in groups of ``g`` (``int4-g{g}[-zp]``, two codes a byte, even ``k`` in the low nibble):
  each K step lies in one group (``BLOCK_K`` divides ``g``) and its tile is dequantized first,
  ``w = (q[n, k] - z) · s[n, k // g]`` in float32 rounded to the operands' dtype — the weights the
  scheme's reference dequantizes to — with ``z = 8`` or the stored zero point, so the even and
  odd inputs' dots chain into one accumulator.

At decode sizes (``quant_moe_experts``'s ``gemv``) int4 and fp8 stacks run :mod:`.moe_gemv`'s
one-pair-a-row kernels instead: the dense decode GEMV's one-row loops, several times faster there.
Stacks kept in a GGUF file's blocks (``gguf-<type>``, both stacks) run :mod:`.moe_gguf`'s kernels
of the same two shapes, which decode the blocks as the dense GGUF kernels do.

File shape (STYLE.md 11): the weight-tile helper and the three ``@triton.jit`` kernels, the align
step, the launcher that picks tiles with one heuristic (:func:`_pick_config`) and checks its
arguments, the public wrappers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.quant import Fp8Scheme, IntScheme, QuantScheme

from ..device import triton_interprets
from ..gguf_scheme import GGUFScheme
from . import moe_gemv, moe_gguf
from .moe_gemv import _act, _block_of_pairs, _channel_scale
from .paged_attention import _mm
from .row_topk import row_topk, row_topk_supported

__all__ = ["moe_experts", "quant_moe_experts", "moe_align", "moe_supported", "quant_moe_supported", "MoeConfig",
           "one_pair_by_default"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DENSE, PER_CHANNEL, INT4, GGUF = 0, 1, 2, 3     # how a stack's weight tiles are stored (the kernels' QUANT)


@triton.jit
def _a_tile(rows_ptr, row_ok, k0, K, BLOCK_K: tl.constexpr, QUANT: tl.constexpr):
    """One K step of the activations, ``(a, a2)``: ``a = A[:, k0:k0 + BLOCK_K]`` (``a2`` the same),
    or for int4 codes (``QUANT == 2``, a byte holding inputs ``2j`` and ``2j + 1``) the step's even
    and odd inputs, each ``[BLOCK_M, BLOCK_K / 2]``, so the weight bytes load whole."""
    if QUANT == 2:
        kk = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        m = row_ok[:, None] & (kk < K)[None, :]
        a = tl.load(rows_ptr + kk[None, :], mask=m, other=0.0)
        a2 = tl.load(rows_ptr + kk[None, :] + 1, mask=m, other=0.0)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(rows_ptr + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
        a2 = a
    return a, a2


@triton.jit
def _w_step(acc, a, a2, w_e, s_e, z_e, n, n_ok, swn, ssn, k0, K, BLOCK_K: tl.constexpr,
            QUANT: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr, DOT_PREC: tl.constexpr,
            DOT_F32: tl.constexpr):
    """``acc + A_step @ W[n, k0:k0 + BLOCK_K]ᵀ`` for one K step (``a, a2`` from :func:`_a_tile`),
    ``W`` read as its stack stores it (module docstring): the weights (``DENSE``), per-channel codes
    (``PER_CHANNEL``: the scale left to the caller, after the loop) or int4 bytes, whose low and high
    nibbles, dequantized with the step's group scale and zero point, multiply the even and odd
    inputs (``INT4``)."""
    rows = n[None, :].to(tl.int64) * swn
    if QUANT == 2:         # (one return at the end: Triton compiles what follows a return in a static if)
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = n_ok[None, :] & (j < K // 2)[:, None]
        byte = tl.load(w_e + rows + j[:, None], mask=mask, other=0).to(tl.int32)       # [BLOCK_K / 2, BLOCK_N]
        g = k0 // GROUP
        s = tl.load(s_e + n.to(tl.int64) * ssn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ZP:             # (a masked byte's value multiplies a zero input or lands in an unstored column)
            z = tl.load(z_e + n.to(tl.int64) * ssn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:
            z = 8.0
        # the tile dequantized as the scheme's reference dequantizes, (q - z) · s in float32 rounded to the
        # operands' dtype, so the two dots chain into the accumulator (a partial sum scaled after each dot
        # kept a second accumulator live beside each of gate/up's)
        base = z + 8388608.0   # a nibble OR-ed into the bits of 2^23 is 2^23 + q exactly: no I2F conversion
        lo = ((((byte & 15) | 0x4B000000).to(tl.float32, bitcast=True) - base) * s).to(a.dtype)
        hi = ((((byte >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - base) * s).to(a.dtype)
        acc = acc + _mm(a, lo, DOT_PREC, DOT_F32)
        acc = acc + _mm(a2, hi, DOT_PREC, DOT_F32)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_e + rows + kk[:, None], mask=n_ok[None, :] & (kk < K)[:, None], other=0.0)
        if QUANT == 1:
            w = w.to(tl.float32).to(a.dtype)
        acc = acc + _mm(a, w, DOT_PREC, DOT_F32)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, sx,                 # tokens [T, H] (inner stride 1), row stride
    w_ptr, swe, swn,           # gate_up [E, 2I, H] or its codes (inner stride 1): expert and row strides
    s_ptr, z_ptr, sse, ssn,    # scales and zero points [E, 2I, G] (quantized stacks): expert and row strides
    h_ptr,                     # out: act(gate)·up per pair [P, I], contiguous
    rows_ptr, blk_e_ptr,       # align: pair index per padded row, expert per block
    P, H, I, E, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GEGLU: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,   # DOT_F32: interpreter only
    QUANT: tl.constexpr = 0, GROUP: tl.constexpr = 1, ZP: tl.constexpr = False,
):
    """h[p, n] = act(x[p // k] · gate_e[n], x[p // k] · up_e[n]) for the pairs of block ``b``."""
    e, rows, valid, n, n_ok = _block_of_pairs(rows_ptr, blk_e_ptr, P, I, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    tok = tl.where(valid, rows // TOP_K, 0)
    w_e = w_ptr + e.to(tl.int64) * swe
    s_e, z_e = s_ptr + e.to(tl.int64) * sse, z_ptr + e.to(tl.int64) * sse
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + tok[:, None].to(tl.int64) * sx
    for k0 in range(0, H, BLOCK_K):
        a, a2 = _a_tile(x_rows, valid, k0, H, BLOCK_K, QUANT)
        acc_g = _w_step(acc_g, a, a2, w_e, s_e, z_e, n, n_ok, swn, ssn, k0, H, BLOCK_K, QUANT, GROUP, ZP, DOT_PREC,
                        DOT_F32)
        acc_u = _w_step(acc_u, a, a2, w_e, s_e, z_e, n + I, n_ok, swn, ssn, k0, H, BLOCK_K, QUANT, GROUP, ZP,
                        DOT_PREC, DOT_F32)
    acc_g = _channel_scale(acc_g, s_e, n, n_ok, ssn, QUANT)
    acc_u = _channel_scale(acc_u, s_e, n + I, n_ok, ssn, QUANT)
    h = _act(acc_g, acc_u, GEGLU)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,                     # act(gate)·up per pair [P, I], contiguous
    w_ptr, swe, swn,           # down [E, H, I] or its codes (inner stride 1): expert and row strides
    s_ptr, z_ptr, sse, ssn,    # scales and zero points [E, H, G] (quantized stacks): expert and row strides
    wt_ptr,                    # routing weight per pair [P], float32
    y_ptr,                     # out: weighted expert outputs per pair [P, H], float32
    rows_ptr, blk_e_ptr,
    P, H, I, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT_F32: tl.constexpr, QUANT: tl.constexpr = 0, GROUP: tl.constexpr = 1, ZP: tl.constexpr = False,
):
    """y[p, n] = weight(p) · h[p] · down_e[n] for the pairs of block ``b``."""
    e, rows, valid, n, n_ok = _block_of_pairs(rows_ptr, blk_e_ptr, P, H, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    safe = tl.where(valid, rows, 0).to(tl.int64)
    w_e = w_ptr + e.to(tl.int64) * swe
    s_e, z_e = s_ptr + e.to(tl.int64) * sse, z_ptr + e.to(tl.int64) * sse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h_rows = h_ptr + safe[:, None] * I
    for k0 in range(0, I, BLOCK_K):
        a, a2 = _a_tile(h_rows, valid, k0, I, BLOCK_K, QUANT)
        acc = _w_step(acc, a, a2, w_e, s_e, z_e, n, n_ok, swn, ssn, k0, I, BLOCK_K, QUANT, GROUP, ZP, DOT_PREC,
                      DOT_F32)
    acc = _channel_scale(acc, s_e, n, n_ok, ssn, QUANT)
    wt = tl.load(wt_ptr + safe, mask=valid, other=0.0)
    tl.store(y_ptr + safe[:, None] * H + n[None, :], acc * wt[:, None], mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _align_kernel(
    ids_ptr,                   # [P] expert of each (token, choice) pair (int32/int64)
    rows_ptr,                  # out: [NUM_BLOCKS * BLOCK_M] int32, pair index per padded row (P: padding)
    blk_e_ptr,                 # out: [NUM_BLOCKS] int32, expert per block (E: past the last)
    P, E, NUM_BLOCKS,
    P_PAD: tl.constexpr, E_PAD: tl.constexpr, NB_PAD: tl.constexpr, ROWS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """:func:`moe_align` in one program, for few pairs (decode): counts per expert, padded block
    starts (a cumulative sum), each pair's rank among the earlier pairs of its expert, then the
    scatter of pair indices and the expert of each block (the number of expert ends at or before
    the block's first row)."""
    p = tl.arange(0, P_PAD)
    pm = p < P
    e = tl.load(ids_ptr + p, mask=pm, other=E_PAD).to(tl.int32)
    lanes = tl.arange(0, E_PAD)
    onehot = e[:, None] == lanes[None, :]                                       # [P_PAD, E_PAD]
    counts = tl.sum(onehot.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    earlier = (p[None, :] < p[:, None]) & (e[None, :] == e[:, None])            # [P_PAD, P_PAD]
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    pos = tl.sum(tl.where(onehot, starts[None, :], 0), axis=1) + rank
    r = tl.arange(0, ROWS_PAD)
    tl.store(rows_ptr + r, tl.zeros([ROWS_PAD], tl.int32) + P, mask=r < NUM_BLOCKS * BLOCK_M)
    tl.debug_barrier()
    tl.store(rows_ptr + pos, p, mask=pm)
    b = tl.arange(0, NB_PAD)
    blk = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(blk_e_ptr + b, tl.minimum(blk, E), mask=b < NUM_BLOCKS)


_ALIGN_KERNEL_MAX_PAIRS = 128      # the one-program align's [P, P] and [P, E] tiles stay small


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the pairs of ``ids [T, k]`` (expert per token choice) by expert, blocks of ``block_m``.

    Returns ``rows [num_blocks · block_m]`` int32 (pair index ``t·k + j``, or ``P = T·k`` for padding)
    and ``block_expert [num_blocks]`` int32 (``num_experts`` for blocks past the last), where
    ``num_blocks = cdiv(P, block_m) + min(num_experts, P)``. Pairs keep their order within an expert.
    """
    flat = ids.reshape(-1)
    p, dev = flat.numel(), flat.device
    num_blocks = triton.cdiv(p, block_m) + min(num_experts, p)
    interp = triton_interprets()
    if (dev.type == "cuda" or interp) and 0 < p <= _ALIGN_KERNEL_MAX_PAIRS and num_experts <= 512:
        rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        _align_kernel[(1,)](flat.contiguous(), rows, block_expert, p, num_experts, num_blocks,
                            P_PAD=triton.next_power_of_2(p), E_PAD=triton.next_power_of_2(num_experts),
                            NB_PAD=triton.next_power_of_2(num_blocks),
                            ROWS_PAD=triton.next_power_of_2(num_blocks * block_m), BLOCK_M=block_m, num_warps=8)
        return rows, block_expert
    flat = flat.long()
    onehot = torch.nn.functional.one_hot(flat, num_experts).to(torch.int32)      # [P, E]
    before = (onehot.cumsum(0) - onehot).gather(1, flat[:, None]).squeeze(1)    # rank of the pair in its expert
    counts = onehot.sum(0)
    ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    starts = ends - (counts + block_m - 1) // block_m * block_m
    rows = torch.full((num_blocks * block_m,), p, dtype=torch.int32, device=dev)
    rows.scatter_(0, (starts[flat] + before).long(), torch.arange(p, dtype=torch.int32, device=dev))
    first_row = torch.arange(num_blocks, device=dev, dtype=ends.dtype) * block_m
    block_expert = torch.searchsorted(ends, first_row, right=True).to(torch.int32)
    return rows, block_expert


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters: rows a block, and per kernel (gate/up, down) its ``(BLOCK_N, BLOCK_K,
    num_warps, num_stages)``."""

    block_m: int
    up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


def _pick_config(pairs: int, dtype: torch.dtype = torch.bfloat16, int4: bool = False) -> MoeConfig:
    """16 rows a block for decode-sized batches (the weights dominate: long K steps, deep pipelines;
    the H200 sweep of benchmarks/moe.py at Mixtral's size, one token: 254 -> 222 µs), 64 for prefill.
    float32 operands take twice the shared memory a stage: half the K step. int4 stacks at prefill
    sizes take narrower tiles with longer K steps, so each program dequantizes fewer codes a step
    (H200, Mixtral's experts at 512 tokens: 7800 µs in the bf16 launch, 3727 in this one; bf16 1435)."""
    if pairs <= 64:
        if dtype == torch.float32:
            return MoeConfig(16, (32, 128, 4, 4), (64, 128, 4, 3))
        return MoeConfig(16, (32, 256, 4, 5), (64, 256, 4, 4))
    if int4:
        return MoeConfig(64, (64, 128, 4, 4), (64, 128, 4, 4))
    return MoeConfig(64, (128, 64, 4, 3), (128, 64, 4, 3))


def moe_supported(x: torch.Tensor, routing: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str | None:
    """Why :func:`moe_experts` cannot take these operands (None: it can)."""
    if x.dtype not in _DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        return f"dtypes x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}"
    if x.dim() != 2 or routing.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        return "ranks"
    if x.stride(-1) != 1 or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        return "non-unit inner strides"
    return None


@dataclass(frozen=True)
class _Stack:
    """One expert stack as the kernels read it: ``codes [E, N, ...]`` (the weights themselves when
    ``quant`` is ``DENSE``) and, for quantized stacks, ``scale`` and ``zero`` ``[E, N, G]`` (the codes
    again where there are none: never read)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    quant: int = DENSE
    group: int = 1
    zero_point: bool = False
    qtype: str = ""            # GGUF: the GGML block type of ``codes [E, N, row bytes]``

    @classmethod
    def of(cls, scheme: QuantScheme | None, stored) -> "_Stack":
        """The stack of a dense weight (``scheme`` None, ``stored`` the tensor) or of a scheme's
        stacked companions (``stored`` a list, :meth:`QuantScheme.stack_companions` order)."""
        if scheme is None:
            return cls(stored, stored, stored)
        if isinstance(scheme, GGUFScheme):
            return cls(stored[0], stored[0], stored[0], GGUF, qtype=scheme.qtype)
        if isinstance(scheme, IntScheme) and scheme.bits == 4:
            zero = stored[2] if scheme.zero_point else stored[1]
            return cls(stored[0], stored[1], zero, INT4, scheme.group_size, scheme.zero_point)
        return cls(stored[0], stored[1], stored[1], PER_CHANNEL)

    def args(self) -> tuple:
        """The kernels' ``w_ptr, swe, swn, s_ptr, z_ptr, sse, ssn``."""
        return (self.codes, self.codes.stride(0), self.codes.stride(1), self.scale, self.zero, self.scale.stride(0),
                self.scale.stride(1))

    def consts(self, block_k: int) -> dict:
        """``QUANT``, ``GROUP``, ``ZP`` and the K step: an int4 step lies inside one group."""
        return dict(QUANT=self.quant, GROUP=self.group, ZP=self.zero_point,
                    BLOCK_K=min(block_k, self.group) if self.quant == INT4 else block_k)


def quant_moe_supported(x: torch.Tensor, routing: torch.Tensor, schemes: tuple[QuantScheme, QuantScheme],
                        stacks: tuple[list, list]) -> str | None:
    """Why :func:`quant_moe_experts` cannot take these operands (None: it can)."""
    if x.dtype not in _DTYPES or x.dim() != 2 or routing.dim() != 2 or x.stride(-1) != 1:
        return f"x {x.dtype} {list(x.shape)} strides {x.stride()}"
    gguf = [isinstance(scheme, GGUFScheme) for scheme in schemes]
    if any(gguf) and not all(gguf):
        return f"schemes {schemes[0].name} and {schemes[1].name}: GGUF stacks run with GGUF stacks only"
    for scheme, stored in zip(schemes, stacks):
        if not (isinstance(scheme, (IntScheme, Fp8Scheme, GGUFScheme)) and scheme.stackable):
            return f"scheme {scheme.name}"
        if isinstance(scheme, Fp8Scheme) and x.device.type == "cuda" \
                and torch.cuda.get_device_capability(x.device) < (8, 9):
            return "fp8 codes before sm_89"
        if any(not t.is_contiguous() for t in stored):
            return "non-contiguous stored tensors"
    return None


def moe_experts(x: torch.Tensor, routing: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *,
                top_k: int, geglu: bool = False, out: torch.Tensor | None = None,
                config: MoeConfig | None = None) -> torch.Tensor:
    """``Σ_e routing[:, e] · mlp_e(x)`` over each token's ``top_k`` largest routing weights (module
    docstring); ``out [T, H]`` in ``x``'s dtype. ``config``: launch parameters (benchmarks' sweeps;
    default :func:`_pick_config`)."""
    why = moe_supported(x, routing, gate_up, down)
    if why is not None:
        raise GraphDSLError(f"moe_experts: unsupported operands ({why})")
    t, hidden = x.shape
    e, two_i, h2 = gate_up.shape
    inter = two_i // 2
    if h2 != hidden or routing.shape != (t, e) or tuple(down.shape) != (e, hidden, inter) or two_i % 2:
        raise GraphDSLError(f"moe_experts: shapes x {list(x.shape)}, routing {list(routing.shape)}, gate_up "
                            f"{list(gate_up.shape)}, down {list(down.shape)} do not fit [T, H], [T, E], [E, 2I, H], "
                            "[E, H, I]")
    return _run(x, routing, _Stack.of(None, gate_up), _Stack.of(None, down), e, inter, top_k, geglu, out, config,
                "moe_experts")


def one_pair_by_default(up: _Stack, down: _Stack, pairs: int, experts: int, dtype: torch.dtype) -> bool:
    """Whether :func:`quant_moe_experts` runs ``pairs`` (token, expert) pairs over quantized stacks
    ``up`` and ``down`` of ``experts`` experts under ``dtype`` activations one pair a program row by
    default (GGUF stacks: :func:`.moe_gguf.one_pair_by_default`; the others
    :func:`.moe_gemv.one_pair_by_default`)."""
    if up.quant == GGUF:
        return moe_gguf.one_pair_by_default(up, down, pairs, experts, dtype)
    return moe_gemv.one_pair_by_default(up, down, pairs, experts)


def quant_moe_experts(x: torch.Tensor, routing: torch.Tensor, gate_up: list[torch.Tensor],
                      down: list[torch.Tensor], *, schemes: tuple[QuantScheme, QuantScheme], top_k: int,
                      geglu: bool = False, out: torch.Tensor | None = None,
                      config: MoeConfig | None = None, gemv: bool | None = None) -> torch.Tensor:
    """:func:`moe_experts` over stacks stored in weight-only ``schemes`` (gate/up's, down's):
    ``gate_up`` and ``down`` are their stacked companions (module docstring). ``gemv``: run the
    one-pair-a-row kernels of :mod:`.moe_gemv` (True) or the grouped ones (False); None: one pair a
    row as :func:`one_pair_by_default` says (GGUF stacks: ``config`` is the tile kernels' launch,
    :func:`.moe_gguf.grouped_config`)."""
    why = quant_moe_supported(x, routing, schemes, (gate_up, down))
    if why is not None:
        raise GraphDSLError(f"quant_moe_experts: unsupported operands ({why})")
    t, hidden = x.shape
    e, two_i = gate_up[0].shape[:2]
    inter = two_i // 2
    want_up = schemes[0].stack_companions(e, two_i, hidden)
    want_down = schemes[1].stack_companions(e, hidden, inter)
    for name, want, got in (("gate_up", want_up, gate_up), ("down", want_down, down)):
        if len(want) != len(got) or any(tuple(g.shape) != c.shape for c, g in zip(want, got)) or routing.shape != (t, e):
            raise GraphDSLError(f"quant_moe_experts: {name} stored {[list(g.shape) for g in got]} do not fit "
                                f"{[list(c.shape) for c in want]} for x {list(x.shape)}, routing {list(routing.shape)}")
    up, dn = _Stack.of(schemes[0], gate_up), _Stack.of(schemes[1], down)
    if gemv is None:
        gemv = config is None and one_pair_by_default(up, dn, t * top_k, e, x.dtype)
    return _run(x, routing, up, dn, e, inter, top_k, geglu, out, config, "quant_moe_experts", gemv)


def choices(routing: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32, ids)`` ``[T, top_k]``: each token's ``top_k`` largest routing weights, in
    one launch (:mod:`.row_topk`) where it takes the rows, else ``torch.topk``."""
    routing = routing.contiguous()
    weights, ids = row_topk(routing, top_k) if row_topk_supported(routing, top_k) is None \
        else routing.topk(top_k, dim=-1)
    return weights.float(), ids


def _run(x, routing, up: _Stack, down: _Stack, e: int, inter: int, top_k: int, geglu: bool, out, config,
         op: str, gemv: bool = False) -> torch.Tensor:
    """Align the pairs, launch gate/up then down (grouped, or ``gemv``: one pair a program row; GGUF
    stacks: :func:`.moe_gguf.gguf_experts`), sum each token's ``top_k`` outputs into ``out``."""
    if not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise GraphDSLError(f"{op}: top_k must be an int in [1, {e}], got {top_k!r}")
    t, hidden = x.shape
    if out is None:
        out = torch.empty_like(x)
    if t == 0:
        return out
    interp = triton_interprets()
    route = routing if routing.stride(-1) == 1 else routing.contiguous()     # rows may sit apart, not entries
    if up.quant == GGUF:                    # both stacks in GGUF blocks (quant_moe_supported)
        return moe_gguf.gguf_experts(x, route, up, down, inter, top_k, geglu, interp, out, gemv, config)
    if gemv:
        return moe_gemv.gemv_experts(x, route, up, down, inter, top_k, geglu, interp, out)
    weights, ids = choices(routing, top_k)
    pairs = t * top_k
    cfg = config or _pick_config(pairs, x.dtype, up.quant == INT4)
    rows, block_expert = moe_align(ids, e, cfg.block_m)
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    num_blocks = block_expert.numel()
    common = dict(BLOCK_M=cfg.block_m, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", DOT_F32=interp)

    def launch(kcfg, stack: _Stack):
        bn, bk, warps, stages = kcfg
        return dict(BLOCK_N=bn, num_warps=warps, num_stages=1 if interp else stages, **stack.consts(bk), **common)

    _gate_up_kernel[(num_blocks, triton.cdiv(inter, cfg.up[0]))](
        x, x.stride(0), *up.args(), h, rows, block_expert,
        pairs, hidden, inter, e, TOP_K=top_k, GEGLU=geglu, **launch(cfg.up, up))
    _down_kernel[(num_blocks, triton.cdiv(hidden, cfg.down[0]))](
        h, *down.args(), weights.reshape(-1).contiguous(), y, rows, block_expert,
        pairs, hidden, inter, e, **launch(cfg.down, down))
    return moe_gemv.finish(y.view(1, pairs, hidden), out, top_k)
