"""Triton kernel for ``compute_logprobs``: raw logprobs of the sampled tokens and the top ``num``, in one launch.

Semantics (``graphdsl.runtime.serving.sampler.compute_logprobs``), per row ``r`` of float32
logits ``l`` (vocab ``V``) and its token ``x``: ``lse = log sum_t exp(l_t)``; the top ``num``
tokens by logit (ties -> lowest id) with ``l_t - lse``; ``l_x - lse``; and the rank ``1 + #{t :
l_t > l_x}`` (strictly larger logits: the logprob order of exact arithmetic, which float
rounding of ``l - lse`` cannot blur).

Grid ``(R, C)`` over ``BLOCK``-wide chunks: each program writes its chunk's max ``m_c``, ``s_c =
sum exp(l - m_c)``, the count of logits above ``l_x`` and its top ``NUMP`` (value, id) pairs; the
row's last program (an arrival counter, zero on entry) combines them in chunk order: ``lse = M +
log sum_c s_c exp(m_c - M)``, the top ``num`` of the chunks' candidates (each chunk's top ``NUMP
>= num`` holds every token of the row's top ``num`` that lies in it).

File shape (STYLE.md 11): the kernel, the launch heuristic :func:`_pick_block`, the public
wrapper :func:`logprobs`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .pdl import pdl_launch, pdl_wait

__all__ = ["logprobs", "MAX_NUM"]

MAX_NUM = 64                 # top entries per row the kernel returns (OpenAI allows 20)
_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _logprobs_kernel(
    logits_ptr,     # [R, V] float32, unit stride along V
    stride_lr,      # logits stride between rows
    tokens_ptr,     # [R] int64 the token of each row
    part_f_ptr,     # [2, R, C] float32 scratch: chunk max, chunk sum of exp(l - max)
    part_n_ptr,     # [R, C] int32 scratch: logits in the chunk above the token's
    part_v_ptr,     # [R, C, NUMP] float32 scratch: the chunk's largest logits
    part_i_ptr,     # [R, C, NUMP] int32 scratch: their ids (V: none)
    arrived_ptr,    # [R] int32 programs of the row done so far (zero on entry)
    top_ids_ptr,    # [R, num] int64 out
    top_lp_ptr,     # [R, num] float32 out
    tok_lp_ptr,     # [R] float32 out
    rank_ptr,       # [R] int64 out
    V, C, num,
    NUMP: tl.constexpr,          # power of two >= num (>= 1)
    CBLOCK: tl.constexpr,        # power of two >= C
    BLOCK: tl.constexpr,         # chunk width
    USE_PDL: tl.constexpr,
):
    """Program ``(r, c)`` summarises chunk ``c`` of row ``r``; the row's last program writes
    ``top_ids/top_lp[r, :num]`` (descending, ties -> lowest id), ``tok_lp[r] = l_x - lse`` and
    ``rank[r] = 1 + #{t : l_t > l_x}``."""
    pdl_wait(USE_PDL)
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = logits_ptr + r.to(tl.int64) * stride_lr
    offs = c * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    l = tl.load(row + offs, mask=inside, other=_NEG_INF)
    l_tok = tl.load(row + tl.load(tokens_ptr + r))
    m = tl.max(l, axis=0)
    s = tl.sum(tl.where(l > _NEG_INF, tl.exp(l - m), 0.0), axis=0)
    RC = r * C + c
    tl.store(part_f_ptr + RC, m)
    tl.store(part_f_ptr + tl.num_programs(0) * C + RC, s)
    tl.store(part_n_ptr + RC, tl.sum((l > l_tok).to(tl.int32), axis=0))
    avail = inside
    for i in tl.static_range(NUMP):
        v = tl.max(tl.where(avail, l, _NEG_INF), axis=0)
        idx = tl.min(tl.where(avail & (l == v), offs, V), axis=0)
        tl.store(part_v_ptr + RC * NUMP + i, v)
        tl.store(part_i_ptr + RC * NUMP + i, idx)
        avail = avail & (offs != idx)
    tl.debug_barrier()
    if tl.atomic_add(arrived_ptr + r, 1, sem="acq_rel") == C - 1:      # the row's last program
        cs = tl.arange(0, CBLOCK)
        pm = tl.load(part_f_ptr + r * C + cs, mask=cs < C, other=_NEG_INF, cache_modifier=".cg")
        ps = tl.load(part_f_ptr + tl.num_programs(0) * C + r * C + cs, mask=cs < C, other=0.0,
                     cache_modifier=".cg")
        M = tl.max(pm, axis=0)
        lse = M + tl.log(tl.sum(tl.where(pm > _NEG_INF, ps * tl.exp(pm - M), 0.0), axis=0))
        above = tl.sum(tl.load(part_n_ptr + r * C + cs, mask=cs < C, other=0, cache_modifier=".cg"), axis=0)
        tl.store(tok_lp_ptr + r, l_tok - lse)
        tl.store(rank_ptr + r, (above + 1).to(tl.int64))
        k = tl.arange(0, CBLOCK * NUMP)
        cand = (r * C) * NUMP + k
        cv = tl.load(part_v_ptr + cand, mask=k < C * NUMP, other=_NEG_INF, cache_modifier=".cg")
        ci = tl.load(part_i_ptr + cand, mask=k < C * NUMP, other=V, cache_modifier=".cg")
        left = ci < V                  # (new names: the GPU compiler keeps each name's type and shape)
        for j in range(0, num):
            v = tl.max(tl.where(left, cv, _NEG_INF), axis=0)
            idx = tl.min(tl.where(left & (cv == v), ci, V), axis=0)
            tl.store(top_ids_ptr + r * num + j, idx.to(tl.int64))
            tl.store(top_lp_ptr + r * num + j, v - lse)
            left = left & (ci != idx)


def _pick_block(vocab: int) -> tuple[int, int]:
    """Chunk width and warps from the vocab alone (a row's arithmetic is the same in every batch):
    2048-element chunks at 4 warps, as the sampling kernels (63 programs per row at vocab 128256)."""
    return min(2048, triton.next_power_of_2(vocab)), 4


def _interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, num: int):
    """``(top_ids int64 [R, num], top_logprobs float32 [R, num], token_logprob float32 [R],
    token_rank int64 [R])`` of float32 ``logits [R, V]`` (unit stride along V) and int64 ``tokens
    [R]``, ``0 <= num <= MAX_NUM``; see the module docstring. No host sync."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise GraphDSLError(f"logprobs: logits must be a float32 tensor [R, V], got "
                            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    R, V = logits.shape
    if V == 0 or (V > 1 and logits.stride(1) != 1):
        raise GraphDSLError(f"logprobs: logits must have V >= 1 and unit stride along V, got shape "
                            f"{tuple(logits.shape)} strides {tuple(logits.stride())}")
    if not 0 <= num <= min(MAX_NUM, V):
        raise GraphDSLError(f"logprobs: num must be in [0, {min(MAX_NUM, V)}], got {num}")
    if logits.device.type != "cuda" and not _interpreted(_logprobs_kernel):
        raise GraphDSLError(f"logprobs: logits.device must be cuda (or TRITON_INTERPRET=1 set before triton "
                            f"was imported), got {logits.device}")
    dev = logits.device
    top_ids = torch.empty(R, num, dtype=torch.int64, device=dev)
    top_lp = torch.empty(R, num, dtype=torch.float32, device=dev)
    tok_lp = torch.empty(R, dtype=torch.float32, device=dev)
    rank = torch.empty(R, dtype=torch.int64, device=dev)
    if R == 0:
        return top_ids, top_lp, tok_lp, rank
    block, warps = _pick_block(V)
    C = triton.cdiv(V, block)
    nump = triton.next_power_of_2(max(num, 1))
    part_f = torch.empty(2, R, C, dtype=torch.float32, device=dev)
    part_n = torch.empty(R, C, dtype=torch.int32, device=dev)
    part_v = torch.empty(R, C, nump, dtype=torch.float32, device=dev)
    part_i = torch.empty(R, C, nump, dtype=torch.int32, device=dev)
    arrived = torch.zeros(R, dtype=torch.int32, device=dev)
    outs = (top_ids, top_lp) if num else (rank, tok_lp)      # num = 0: no stores; empty tensors have no memory
    _logprobs_kernel[(R, C)](
        logits, logits.stride(0), tokens, part_f, part_n, part_v, part_i, arrived, *outs, tok_lp,
        rank, V, C, num, NUMP=nump, CBLOCK=triton.next_power_of_2(C), BLOCK=block, num_warps=warps,
        **pdl_launch(dev))
    return top_ids, top_lp, tok_lp, rank
