"""Triton GEMV for decode: ``out = x @ w.T (+ add)`` for a few rows ``x`` (M <= 16).

At decode batch sizes a projection reads its whole weight ``w [N, K]`` to produce a handful of
rows, so the op is bound by the bytes of ``w`` and by how many of them are in flight. The kernel:

* **Tiles.** Program ``(n, s)`` owns ``BLOCK_N`` output columns and the ``s``-th of ``SPLIT_K``
  equal slices of K. It streams its ``[BLOCK_N, K / SPLIT_K]`` slab of ``w`` in
  ``[BLOCK_N, BLOCK_K]`` tiles (contiguous along K) and multiplies each by the matching
  ``[16, BLOCK_K]`` slice of the rows (M padded to 16 with masked loads) with ``tl.dot``, so the
  compiler software-pipelines the weight loads ``num_stages`` deep through shared memory, which is
  what keeps enough bytes in flight. Accumulation is float32.
* **Split-K without a second launch.** With ``SPLIT_K > 1`` each program writes its float32 partial
  tile to a workspace and bumps the tile's arrival counter (a release/acquire atomic); the program
  that arrives last sums the ``SPLIT_K`` partials *in slice order* (so results do not depend on
  arrival order), applies the epilogue, stores, and resets the counter to 0 for the next launch
  (so CUDA-graph replays need no memset).
* **Epilogue**: ``+ add`` — a bias ``[N]`` or a residual ``[M, N]``; optionally followed by an
  RMSNorm of the finished rows (:func:`gemv_add_rms_norm`: the residual add + RMSNorm that follows
  the o and down projections of a decoder layer, without a launch of its own).
* **PDL** (:mod:`.pdl`): on Hopper the kernel may launch while its predecessor finishes.

Tried on the H200 and measured slower, so not kept (docs/performance.md has the figures): loading
the rows through a prologue (RMSNorm, SwiGLU computed while loading; loads that do not feed the
dot directly are not software-pipelined, so each K step waits for them), and prefetching the
start of the weight slab into L2 before the PDL wait.

File shape (STYLE.md 11): the ``@triton.jit`` kernel and its epilogue helper, the launch heuristic
:func:`_pick_config`, the split-K :class:`GemvWorkspace`, the public wrapper :func:`gemv`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .pdl import pdl_launch, pdl_wait

__all__ = ["gemv", "gemv_swiglu", "gemv_add_rms_norm", "gemv_supported", "GemvWorkspace", "MAX_ROWS"]

MAX_ROWS = 16
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _finish(acc, add_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_am, stride_om, HAS_ADD: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (transposed output tile) -> out[m, n] = acc[n, m] + add; returns the
    stored tile (rounded to out's dtype) in float32, 0 outside the masks."""
    mask = n_ok[:, None] & m_ok[None, :]
    if HAS_ADD:
        a = tl.load(add_ptr + rm[None, :] * stride_am + rn[:, None], mask=mask, other=0.0)
        acc += a.to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y, mask=mask)
    return tl.where(mask, y.to(tl.float32), 0.0)


@triton.jit
def _norm_rows(y, out_ptr, g_ptr, normed_ptr, ss_ptr, nlock_ptr, rm, M, pid_n, n_tiles, N, eps,
               stride_om, stride_nm, BLOCK_M: tl.constexpr, TILES_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """RMSNorm of whole output rows once every column tile is stored. Each tile's program stores
    the sums of squares of its stored tile ``y`` per row, then bumps one counter; the program that
    arrives last adds the ``n_tiles`` partial sums in tile order, ``rstd = 1 / sqrt(ss / N + eps)``,
    and writes ``normed = g * (out * rstd)`` (rounded to the dtype before the weight, as the
    unfused RMSNorm) one whole row at a time, then resets the counter."""
    tl.store(ss_ptr + pid_n * BLOCK_M + rm, tl.sum(y * y, axis=0))
    tl.debug_barrier()
    arrived = tl.atomic_add(nlock_ptr, 1, sem="acq_rel")
    if arrived == n_tiles - 1:
        rt = tl.arange(0, TILES_PAD)
        parts = tl.load(ss_ptr + rt[:, None] * BLOCK_M + rm[None, :], mask=(rt < n_tiles)[:, None], other=0.0,
                        cache_modifier=".cg")
        rstd = tl.rsqrt(tl.sum(parts, axis=0) / N + eps)
        dt = normed_ptr.dtype.element_ty
        rc = tl.arange(0, N_PAD)
        n_ok = rc < N
        g = tl.load(g_ptr + rc, mask=n_ok, other=0.0)
        for m in range(0, M):
            r = tl.sum(tl.where(rm == m, rstd, 0.0), axis=0)
            v = tl.load(out_ptr + m * stride_om + rc, mask=n_ok, other=0.0, cache_modifier=".cg")
            h = (v.to(tl.float32) * r).to(dt)
            tl.store(normed_ptr + m * stride_nm + rc, (g * h).to(dt), mask=n_ok)
        tl.atomic_xchg(nlock_ptr, 0)


@triton.jit
def _stream(w_rows, x_rows, n_ok, m_ok, k_lo, k_hi, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """acc[n, m] = sum over k in [k_lo, k_hi) of w[n, k] * x[m, k]: the pipelined weight stream."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0) if not EVEN_N \
                else tl.load(w_rows + kk[None, :])
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)))
        else:
            acc += tl.dot(w, tl.trans(a))
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,          # [M, K] rows, last dim contiguous
    w_ptr,          # [N, K] weight, row-major contiguous (HF [out, in] layout)
    add_ptr,        # [M, N] residual / [N] bias (HAS_ADD) or unused
    out_ptr,        # [M, N] output, last dim contiguous
    part_ptr,       # [SPLIT_K, n_tiles, BLOCK_N, BLOCK_M] float32 partial tiles (SPLIT)
    lock_ptr,       # [n_tiles] int32 arrival counters, zero between launches (SPLIT)
    g_ptr,          # [N] RMSNorm weight (NORM) or unused
    normed_ptr,     # [M, N] normed output (NORM) or unused
    ss_ptr,         # [n_tiles, BLOCK_M] float32 per-tile sums of squares (NORM)
    nlock_ptr,      # [1] int32 counter of stored tiles, zero between launches (NORM)
    M, N, K, SPLIT_K, K_SPLIT,   # sizes; K_SPLIT = K elements per slice (a multiple of BLOCK_K)
    stride_xm, stride_am, stride_om, stride_nm, eps,
    HAS_ADD: tl.constexpr,
    NORM: tl.constexpr,          # RMSNorm the finished rows into normed_ptr (out then holds x @ w.T + add)
    TILES_PAD: tl.constexpr,     # n_tiles rounded up to a power of two (NORM)
    N_PAD: tl.constexpr,         # N rounded up to a power of two (NORM: one row per step)
    SPLIT: tl.constexpr,         # SPLIT_K > 1
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,        # K % BLOCK_K == 0
    EVEN_N: tl.constexpr,        # N % BLOCK_N == 0
    DOT_F32: tl.constexpr,       # the CPU interpreter's dot mishandles bfloat16: multiply in float32
    USE_PDL: tl.constexpr,       # launched with programmatic dependent launch (kernels/pdl.py)
):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ add[m, n]), float32 accumulation; with NORM also
    normed = rms_norm(out, g, eps) over whole rows (see _norm_rows)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    x_rows = x_ptr + rm[:, None] * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    pdl_wait(USE_PDL)
    acc = _stream(w_rows, x_rows, n_ok, m_ok, k_lo, k_hi, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_F32)
    if SPLIT:
        n_tiles = tl.num_programs(0)
        tile = pid_k * n_tiles + pid_n
        rt = tl.arange(0, BLOCK_N)
        part = part_ptr + tile.to(tl.int64) * (BLOCK_N * BLOCK_M) + rt[:, None] * BLOCK_M + rm[None, :]
        tl.store(part, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(0, SPLIT_K):
                t = s * n_tiles + pid_n
                acc += tl.load(part_ptr + t.to(tl.int64) * (BLOCK_N * BLOCK_M) + rt[:, None] * BLOCK_M
                               + rm[None, :], cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + pid_n, 0)
            y = _finish(acc, add_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_am, stride_om, HAS_ADD)
            if NORM:
                _norm_rows(y, out_ptr, g_ptr, normed_ptr, ss_ptr, nlock_ptr, rm, M, pid_n, n_tiles, N, eps,
                           stride_om, stride_nm, BLOCK_M, TILES_PAD, N_PAD)
    else:
        y = _finish(acc, add_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_am, stride_om, HAS_ADD)
        if NORM:
            _norm_rows(y, out_ptr, g_ptr, normed_ptr, ss_ptr, nlock_ptr, rm, M, pid_n, tl.num_programs(0), N,
                       eps, stride_om, stride_nm, BLOCK_M, TILES_PAD, N_PAD)


@triton.jit
def _gemv_swiglu_kernel(
    x_ptr,          # [M, K] rows, last dim contiguous
    w_ptr,          # [2I, K] packed [gate; up] weight, row-major contiguous
    act_ptr,        # [M, I] silu(gate) * up, last dim contiguous
    gu_ptr,         # [M, 2I] [gate | up], last dim contiguous
    M, I, K,
    stride_xm, stride_am, stride_gm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program n streams gate rows [n*BLOCK_N, (n+1)*BLOCK_N) and the matching up rows (+ I):
    gate = x @ w[rows].T, up = x @ w[I + rows].T (float32, then rounded to the output dtype like the
    unfused GEMM's output), gu = [gate | up], act = silu(gate) * up."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < I
    m_ok = rm < M
    rows = rn.to(tl.int64)
    x_rows = x_ptr + rm[:, None] * stride_xm
    pdl_wait(USE_PDL)
    gate = _stream(w_ptr + rows[:, None] * K, x_rows, n_ok, m_ok, 0, K, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                   EVEN_N, DOT_F32)
    up = _stream(w_ptr + (rows + I)[:, None] * K, x_rows, n_ok, m_ok, 0, K, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                 EVEN_N, DOT_F32)
    mask = n_ok[:, None] & m_ok[None, :]
    dt = gu_ptr.dtype.element_ty
    gate = gate.to(dt)
    up = up.to(dt)
    tl.store(gu_ptr + rm[None, :] * stride_gm + rn[:, None], gate, mask=mask)
    tl.store(gu_ptr + rm[None, :] * stride_gm + I + rn[:, None], up, mask=mask)
    g = gate.to(tl.float32)
    act = g * tl.sigmoid(g) * up.to(tl.float32)
    tl.store(act_ptr + rm[None, :] * stride_am + rn[:, None], act.to(act_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pick_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The launch for ``[m, k] @ [n, k].T``, from the H200 sweeps of ``benchmarks/gemv.py --sweep``
    (CUDA-graph replay, weights from HBM): 64-column tiles, five pipeline stages; 128-element K
    steps once there are more column tiles than half the SMs (Llama-3-8B qkv: 13.7 µs vs 15.8 with
    256), else 256 (8B o: 10.5 vs 11.6 µs). K is split (in one launch) only when the tiles cover
    less than a quarter of the SMs, into at most 4 slices of at least 8 steps each (Llama-3.2-1B's
    down projection, 32 tiles: 11.5 µs at split 4); elsewhere the partial-tile round trip costs
    more than the extra parallelism brings (8B o: 11.2 µs at split 2 vs 10.5 unsplit)."""
    sms = _num_sms(device)
    block_n = 64
    tiles = triton.cdiv(n, block_n)
    block_k = 128 if tiles > sms // 2 else 256
    if k < 4 * block_k:
        block_k = max(16, min(128, _pow2(k)))
    steps = triton.cdiv(k, block_k)
    split = 1
    if tiles < sms // 4:
        while split < 4 and steps // (split * 2) >= 8:
            split *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=5)


class GemvWorkspace:
    """Scratch for :func:`gemv`: per (device, tiles, slices, tile size) a float32 partial-tile
    buffer and zeroed tile counters (split-K), per-tile sums of squares and a zeroed counter (the
    RMSNorm epilogue), allocated on first use and kept (a captured CUDA graph
    holds their addresses). Kernels run one at a time on a stream leave the counters at zero, so
    one workspace serves every GEMV of an engine."""

    def __init__(self):
        self._buffers: dict = {}

    def get(self, device: torch.device, n_tiles: int, split: int, block_n: int):
        """(partial tiles, tile counters, per-tile sums of squares, norm counter)."""
        key = (str(device), n_tiles, split, block_n)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = (
                torch.empty(split * n_tiles * block_n * MAX_ROWS, dtype=torch.float32, device=device),
                torch.zeros(n_tiles, dtype=torch.int32, device=device),
                torch.empty(n_tiles * MAX_ROWS, dtype=torch.float32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))
        return bufs

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for bufs in self._buffers.values() for t in bufs)


def gemv_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes these operands (the backend uses cuBLAS otherwise)."""
    return (x.dim() == 2 and w.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES
            and w.dtype == x.dtype and w.is_contiguous() and x.stride(1) == 1 and x.shape[1] == w.shape[1])


def gemv(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
         workspace: GemvWorkspace | None = None, config: dict | None = None) -> torch.Tensor:
    """``x @ w.T (+ add)`` for ``x [M <= 16, K]`` and ``w [N, K]`` of one dtype (fp16/bf16); ``add``
    is a bias ``[N]`` or a residual ``[M, N]``. ``workspace`` holds split-K scratch (a private one
    is made per call if omitted); ``config`` overrides the launch heuristic (``BLOCK_N, BLOCK_K,
    SPLIT_K, num_warps, num_stages``; benchmarks sweep it)."""
    if not gemv_supported(x, w):
        raise GraphDSLError(f"gemv: needs x [M<= {MAX_ROWS}, K] and a contiguous w [N, K] of one dtype in "
                            f"{[str(d) for d in _DTYPES]}, got x {list(x.shape)} {x.dtype} strides {x.stride()}, "
                            f"w {list(w.shape)} {w.dtype} contiguous={w.is_contiguous()}")
    m = x.shape[0]
    n, k = w.shape
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise GraphDSLError(f"gemv: out must be [{m}, {n}] {x.dtype} with a contiguous last dim, got "
                            f"{list(out.shape)} {out.dtype} strides {out.stride()}")
    if add is not None and tuple(add.shape) not in ((n,), (m, n)):
        raise GraphDSLError(f"gemv: add must be a bias [{n}] or a residual [{m}, {n}], got {list(add.shape)}")
    if add is not None and add.stride(-1) != 1:
        raise GraphDSLError(f"gemv: add must have a contiguous last dim, got strides {add.stride()}")
    return _launch(x, w, add, out, None, workspace, config)


def _launch(x, w, add, out, norm, workspace, config):
    """One launch of :func:`_gemv_kernel`; ``norm`` is ``(norm_weight, eps, normed)`` or None."""
    m, (n, k) = x.shape[0], w.shape
    cfg = dict(config or _pick_config(m, n, k, x.device))
    block_n, block_k, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    steps = triton.cdiv(k, block_k)
    split = max(1, min(split, steps))
    k_split = triton.cdiv(steps, split) * block_k
    split = triton.cdiv(k, k_split)                  # no empty slices
    n_tiles = triton.cdiv(n, block_n)
    if split > 1 or norm is not None:
        part, lock, ss, nlock = (workspace or GemvWorkspace()).get(x.device, n_tiles, split, block_n)
    else:
        part = lock = ss = nlock = out
    g, eps, normed = norm if norm is not None else (out, 0.0, out)
    stride_am = 0 if add is None or add.dim() == 1 else add.stride(0)
    _gemv_kernel[(n_tiles, split)](
        x, w, add if add is not None else out, out, part, lock, g, normed, ss, nlock,
        m, n, k, split, k_split, x.stride(0), stride_am, out.stride(0), normed.stride(0), float(eps),
        HAS_ADD=add is not None, NORM=norm is not None, TILES_PAD=triton.next_power_of_2(n_tiles),
        N_PAD=triton.next_power_of_2(n) if norm is not None else 1,
        SPLIT=split > 1, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, EVEN_N=n % block_n == 0,
        DOT_F32=x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1", **pdl_launch(x.device),
        **cfg)
    return out


def gemv_add_rms_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, *, normed: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      workspace: GemvWorkspace | None = None, config: dict | None = None):
    """``s = x @ w.T + residual`` and ``normed = rms_norm(s, norm_weight, eps)`` in one launch, for
    ``x [M <= 16, K]``, ``w [N, K]``, ``residual [M, N]``; ``out`` receives ``s``. Returns
    ``(normed, s)`` (the order of ``add_rms_norm``). The program that stores the last column tile
    normalises the whole rows (see ``_norm_rows``)."""
    if not gemv_supported(x, w):
        raise GraphDSLError(f"gemv_add_rms_norm: needs x [M<= {MAX_ROWS}, K] and a contiguous w [N, K] of one "
                            f"dtype in {[str(d) for d in _DTYPES]}, got x {list(x.shape)} {x.dtype}, "
                            f"w {list(w.shape)} {w.dtype} contiguous={w.is_contiguous()}")
    m, n = x.shape[0], w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    normed = torch.empty(m, n, dtype=x.dtype, device=x.device) if normed is None else normed
    for name, t, shape in (("residual", residual, (m, n)), ("out", out, (m, n)), ("normed", normed, (m, n)),
                           ("norm_weight", norm_weight, (n,))):
        if tuple(t.shape) != shape or t.stride(-1) != 1 or (name != "norm_weight" and t.dtype != x.dtype):
            raise GraphDSLError(f"gemv_add_rms_norm: {name} must be {list(shape)} with a contiguous last dim"
                                f"{'' if name == 'norm_weight' else f' and dtype {x.dtype}'}, got {list(t.shape)} "
                                f"{t.dtype} strides {t.stride()}")
    _launch(x, w, residual, out, (norm_weight, eps, normed), workspace, config)
    return normed, out


def gemv_swiglu(x: torch.Tensor, w: torch.Tensor, *, act: torch.Tensor | None = None,
                gate_up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of a packed projection in one launch, for ``x [M <= 16, K]`` and ``w [2I, K]``
    (gate rows, then up rows): ``gate_up = x @ w.T`` ``[M, 2I]`` and
    ``act = silu(gate_up[:, :I]) * gate_up[:, I:]`` ``[M, I]``. Returns ``(act, gate_up)``."""
    if not gemv_supported(x, w) or w.shape[0] % 2:
        raise GraphDSLError(f"gemv_swiglu: needs x [M<= {MAX_ROWS}, K] and a contiguous w [2I, K] of one dtype in "
                            f"{[str(d) for d in _DTYPES]}, got x {list(x.shape)} {x.dtype} strides {x.stride()}, "
                            f"w {list(w.shape)} {w.dtype} contiguous={w.is_contiguous()}")
    m, (n2, k) = x.shape[0], w.shape
    i = n2 // 2
    act = torch.empty(m, i, dtype=x.dtype, device=x.device) if act is None else act
    gate_up = torch.empty(m, n2, dtype=x.dtype, device=x.device) if gate_up is None else gate_up
    for name, t, shape in (("act", act, (m, i)), ("gate_up", gate_up, (m, n2))):
        if tuple(t.shape) != shape or t.dtype != x.dtype or t.stride(-1) != 1:
            raise GraphDSLError(f"gemv_swiglu: {name} must be {list(shape)} {x.dtype} with a contiguous last dim, "
                                f"got {list(t.shape)} {t.dtype} strides {t.stride()}")
    cfg = _pick_config(m, n2, k, x.device)          # the tile of the packed projection, half per stream
    block_n, block_k = cfg["BLOCK_N"] // 2, cfg["BLOCK_K"]
    _gemv_swiglu_kernel[(triton.cdiv(i, block_n),)](
        x, w, act, gate_up, m, i, k, x.stride(0), act.stride(0), gate_up.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, EVEN_N=i % block_n == 0,
        DOT_F32=x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1", **pdl_launch(x.device),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return act, gate_up
