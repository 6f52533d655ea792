"""What one persistent kernel would save over a launch per projection: a decode layer's four
batch-1 GEMVs run by one grid that stays resident, against the engine's chained GEMVs.

    python benchmarks/persistent.py [--layers 32] [--shapes 8b,1b] [--configs 64x256x4x4,...]
        [--narrow 0,1] [--per-sm 1] [--poll load,atomic] [--barrier-times] [--without-barriers]

A batch-1 decode step launches about five dependent kernels a layer; ``benchmarks/boundary.py``
measured what each boundary costs (a PDL link 1.1 µs on an H200, a decode GEMV ~2.7-3 µs over its
bytes). This asks whether a grid that never ends does better, before any of it is built into the
engine. It times ``--layers`` layers of the Llama projections, each layer

    h ← h                                   (float32 residual [H])
    qkv = W_qkv · (rmsnorm(h) ⊙ g₁)         [Q + 2·KV]
    h  += W_o · qkv[:H]                     (the attention left out: o reads the q part)
    a   = silu(W_g · x₂) ⊙ (W_u · x₂),  x₂ = rmsnorm(h) ⊙ g₂   (gate/up rows interleaved)
    h  += W_d · a

two ways, each captured in a CUDA graph:

* **engine**: the engine's decode GEMV (:func:`graphdsl.runtime.kernels.gemv.gemv`, PDL, split-K
  in launch) — one launch a projection, the norms left out (the engine carries them in epilogues).
* **persistent** (:func:`_layers`): ``--per-sm`` programs a SM for the whole chain. Program ``p``
  owns a contiguous ``1/G`` of each projection's output rows (whole rows: no split-K) and streams
  them in ``[BLOCK_N, BLOCK_K]`` tiles, by either loop of ``--configs``: a ``tl.dot`` loop that
  Triton pipelines ``STAGES`` deep through shared memory (:func:`_project_dot`, the engine GEMV's
  loop), or FMAs on register tiles with the next tile loaded while one is summed
  (:func:`_project`). Between projections a grid barrier (:func:`_barrier`): every program counts
  its stores into the stage's counter (release) and polls it until all ``G`` have (acquire);
  before it polls it has already asked for its next weights (weights never depend on the step):
  the first tile into registers, or its first K steps into L2. Each program computes the
  RMSNorm's ``rsqrt(mean(h²) + eps)`` from the whole ``h`` itself (``H`` values from L2) and
  multiplies its sums by it; its input ``h ⊙ g`` comes from the projection that last added to
  ``h``, as the engine carries the norm.

Printed: µs a layer against the layer's weight bytes at the measured copy bandwidth; with
``--without-barriers`` also each loop with its barriers left out (the streams alone, results
wrong), and with ``--barrier-times`` how the programs arrive at and leave each barrier
(:func:`barrier_spread`). Each persistent loop is checked against a float32 torch reference of two
layers before it is timed. docs/performance-log.md has the H200 figures. Needs a CUDA GPU; under the
interpreter one program runs it (``G = 1``: every barrier is met by the program itself), which is
how the tests check its arithmetic.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, copy_bandwidth_gbs, device_line, graph_ms  # noqa: E402

from graphdsl.runtime.kernels.pdl import prefetch_l2  # noqa: E402
from graphdsl.runtime.kernels.splitk import slice_ok  # noqa: E402

# (hidden H, qkv rows Q + 2·KV, intermediate I) of Llama-3-8B and Llama-3.2-1B
SHAPES = {"8b": (4096, 6144, 14336), "1b": (2048, 3072, 8192)}
EPS = 1e-5


@triton.jit
def _tile(w_ptr, K, r0, r1, i, n_it, k_steps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile ``i`` of a program's flattened loop over its rows ``[r0, r1)`` of ``w [*, K]``: rows
    ``r0 + (i // k_steps) · BLOCK_N`` on, columns ``(i % k_steps) · BLOCK_K`` on; zeros past ``r1``
    or ``n_it``."""
    c = i // k_steps
    rows = r0 + c * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (i - c * k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < r1) & slice_ok(i, n_it, rows)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=ok[:, None], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _rows_of(pid, G, N, UNIT: tl.constexpr):
    """Program ``pid``'s output rows ``[r0, r1)`` of ``N``: a ``1/G`` share in whole units of ``UNIT``
    rows (2 for interleaved gate/up pairs)."""
    units = N // UNIT
    return (pid * units // G) * UNIT, ((pid + 1) * units // G) * UNIT


@triton.jit
def _first(w_ptr, N, K, pid, G, UNIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``pid``'s first tile of ``w [N, K]`` (issued before a barrier: weights never wait)."""
    r0, r1 = _rows_of(pid, G, N, UNIT)
    return _tile(w_ptr, K, r0, r1, 0, 1, 1, BLOCK_N, BLOCK_K)


@triton.jit
def _now(pid):
    """The GPU's global nanosecond timer (``%globaltimer``; ``pid`` only gives the asm an operand)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _poll(ptr):
    """A load-acquire of the int32 at ``ptr`` (every thread loads it; no read-modify-write)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _barrier(cnt_ptr, j, G, SYNC: tl.constexpr, times_ptr, TIMES: tl.constexpr):
    """Stage ``j`` done: count this program's stores in (release), then spin until all ``G`` have:
    ``SYNC`` 1 polls with atomic adds of 0, 2 with load-acquires, 0 leaves the barrier out (only a
    timing of the streams alone may). ``TIMES``: store the global timer at arrival and at
    departure into ``times[j, pid, 0:2]`` (int64)."""
    if SYNC == 0:
        return
    pid = tl.program_id(0)
    if TIMES:
        tl.store(times_ptr + (j * G + pid) * 2, _now(pid))
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + j, 1, sem="release")
    if SYNC == 1:
        while tl.atomic_add(cnt_ptr + j, 0, sem="acquire") < G:
            pass
    else:
        while _poll(cnt_ptr + j) < G:
            pass
    if TIMES:
        tl.store(times_ptr + (j * G + pid) * 2 + 1, _now(pid))


@triton.jit
def _rstd(h_ptr, H: tl.constexpr, eps):
    """``rsqrt(mean(h²) + eps)`` of the whole float32 row ``h [H]`` (read past L1: other SMs wrote it)."""
    h = tl.load(h_ptr + tl.arange(0, H), cache_modifier=".cg")
    return tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)


@triton.jit
def _store(acc, r, r1, y_ptr, yg_ptr, g_ptr, SWIGLU: tl.constexpr, ADD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the sums ``acc [BLOCK_N]`` of rows ``r ..`` (``< r1``): ``y = acc``; ``ADD``: ``y += acc``
    (float32) and ``yg = y ⊙ g`` (bf16: the next projection's input, its norm scale still to come);
    ``SWIGLU`` (rows ``2c, 2c + 1`` = gate, up of column ``c``): ``y[c] = silu(gate) · up``."""
    rows = r + tl.arange(0, BLOCK_N)
    ok = rows < r1
    if SWIGLU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_N // 2, 2]))
        col = r // 2 + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + col, (gate / (1.0 + tl.exp(-gate)) * up).to(y_ptr.dtype.element_ty), mask=col < r1 // 2)
    elif ADD:
        h = tl.load(y_ptr + rows, mask=ok, other=0.0) + acc
        tl.store(y_ptr + rows, h, mask=ok)
        tl.store(yg_ptr + rows, (h * tl.load(g_ptr + rows, mask=ok, other=0.0).to(tl.float32)).to(tl.bfloat16),
                 mask=ok)
    else:
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _project(w_ptr, N, K, x_ptr, scale, y_ptr, yg_ptr, g_ptr, pid, G, w0, SWIGLU: tl.constexpr,
             ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``pid``'s rows of ``scale · (w [N, K] · x)`` (``x = x_ptr[:K]``, bf16) through FMAs on
    register tiles, the next tile loaded while one is summed; ``w0``: its first tile, already
    loaded. Stored by :func:`_store`."""
    UNIT: tl.constexpr = 2 if SWIGLU else 1
    r0, r1 = _rows_of(pid, G, N, UNIT)
    k_steps = K // BLOCK_K
    n_it = tl.cdiv(r1 - r0, BLOCK_N) * k_steps
    acc = tl.zeros([BLOCK_N], tl.float32)
    w = w0
    for i in range(0, n_it):
        w_next = _tile(w_ptr, K, r0, r1, i + 1, n_it, k_steps, BLOCK_N, BLOCK_K)
        c = i // k_steps
        ks = i - c * k_steps
        x = tl.load(x_ptr + ks * BLOCK_K + tl.arange(0, BLOCK_K), cache_modifier=".cg").to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if ks == k_steps - 1:
            _store(acc * scale, r0 + c * BLOCK_N, r1, y_ptr, yg_ptr, g_ptr, SWIGLU, ADD, BLOCK_N)
            acc = tl.zeros([BLOCK_N], tl.float32)
        w = w_next


@triton.jit
def _project_dot(w_ptr, N, K, x_ptr, scale, y_ptr, yg_ptr, g_ptr, pid, G, SWIGLU: tl.constexpr,
                 ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 ON_GPU: tl.constexpr):
    """:func:`_project` as the engine's GEMV streams: ``tl.dot`` of each ``[BLOCK_N, BLOCK_K]``
    weight tile with the row in column 0 of a ``[BLOCK_K, 16]`` tile, so the compiler pipelines the
    weight tiles ``STAGES`` deep through shared memory. One loop over the program's every
    ``(row tile, K step)``, stores inside it, so the pipeline runs on across row tiles (not
    ``ON_GPU``: the interpreter, whose dot mishandles bfloat16, multiplies in float32)."""
    UNIT: tl.constexpr = 2 if SWIGLU else 1
    r0, r1 = _rows_of(pid, G, N, UNIT)
    k_steps = K // BLOCK_K
    m = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for i in tl.range(0, tl.cdiv(r1 - r0, BLOCK_N) * k_steps, num_stages=STAGES):
        c = i // k_steps
        ks = i - c * k_steps
        rows = r0 + c * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = ks * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=(rows < r1)[:, None], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + cols[:, None] + m[None, :] * 0, mask=(m == 0)[None, :], other=0.0, cache_modifier=".cg")
        if not ON_GPU:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, x, acc)
        if ks == k_steps - 1:
            _store(tl.sum(acc, axis=1) * scale, r0 + c * BLOCK_N, r1, y_ptr, yg_ptr, g_ptr, SWIGLU, ADD, BLOCK_N)
            acc = tl.zeros([BLOCK_N, 16], tl.float32)


@triton.jit
def _stage(w_ptr, N, K, x_ptr, scale, y_ptr, yg_ptr, g_ptr, pid, G, w0, SWIGLU: tl.constexpr, ADD: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ON_GPU: tl.constexpr):
    """One projection by :func:`_project_dot` (``STAGES`` > 0) or :func:`_project`."""
    if STAGES > 0:
        _project_dot(w_ptr, N, K, x_ptr, scale, y_ptr, yg_ptr, g_ptr, pid, G, SWIGLU, ADD, BLOCK_N, BLOCK_K, STAGES,
                     ON_GPU)
    else:
        _project(w_ptr, N, K, x_ptr, scale, y_ptr, yg_ptr, g_ptr, pid, G, w0, SWIGLU, ADD, BLOCK_N, BLOCK_K)


@triton.jit
def _ahead(w_ptr, N, K, pid, G, UNIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           STAGES: tl.constexpr, ON_GPU: tl.constexpr):
    """What a program does for its next projection before a barrier: the FMA loop loads its first
    tile into registers; the pipelined loop asks L2 (``ON_GPU``: not under the interpreter, which
    runs no PTX) for the first two K steps of its first ``BLOCK_N`` rows."""
    if STAGES > 0:
        if ON_GPU:
            r0, r1 = _rows_of(pid, G, N, UNIT)
            rows = tl.minimum(r0 + tl.arange(0, BLOCK_N), r1 - 1)
            prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * K, 0, K, BLOCK_K * 4 // 128, 64)
        return tl.zeros([BLOCK_N, BLOCK_K], tl.bfloat16)
    else:
        return _first(w_ptr, N, K, pid, G, UNIT, BLOCK_N, BLOCK_K)


@triton.jit
def _layers(h_ptr, hg_ptr, qkv_ptr, act_ptr, g1_ptr, g2_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, cnt_ptr, times_ptr,
            LAYERS, eps, H: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ON_GPU: tl.constexpr, NARROW: tl.constexpr,
            SYNC: tl.constexpr, TIMES: tl.constexpr):
    """``LAYERS`` layers of the module docstring's projections, one grid of ``G`` programs, four
    barriers a layer (:func:`_barrier`, whose ``SYNC``, ``times`` and ``TIMES`` these are; counters
    ``cnt [4 · LAYERS]``, zero at launch). ``hg``: ``h ⊙ g`` of the norm ahead (bf16, made by the
    projection that last added to ``h``; at launch ``h ⊙ g₁``), so a normed projection multiplies
    its sums by ``rsqrt(mean(h²) + eps)`` instead of its input. ``NARROW``
    (0 or 1): the o and down projections, whose ``H`` rows give a program about one row tile,
    stream ``[BLOCK_N / 2, 2 · BLOCK_K]`` tiles instead (as many bytes a step, fewer rows masked)."""
    BN_O: tl.constexpr = BLOCK_N >> NARROW
    BK_O: tl.constexpr = BLOCK_K << NARROW
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    w0 = _ahead(wqkv_ptr, QKV, H, pid, G, 1, BLOCK_N, BLOCK_K, STAGES, ON_GPU)
    for layer in range(0, LAYERS):
        lw = tl.cast(layer, tl.int64)
        wqkv = wqkv_ptr + lw * QKV * H
        wo = wo_ptr + lw * H * H
        wgu = wgu_ptr + lw * 2 * INTER * H
        wd = wd_ptr + lw * H * INTER
        j = 4 * layer
        _stage(wqkv, QKV, H, hg_ptr, _rstd(h_ptr, H, eps), qkv_ptr, hg_ptr, g1_ptr, pid, G, w0, False, False,
               BLOCK_N, BLOCK_K, STAGES, ON_GPU)
        w0 = _ahead(wo, H, H, pid, G, 1, BN_O, BK_O, STAGES, ON_GPU)
        _barrier(cnt_ptr, j, G, SYNC, times_ptr, TIMES)
        _stage(wo, H, H, qkv_ptr, 1.0, h_ptr, hg_ptr, g2_ptr, pid, G, w0, False, True, BN_O, BK_O, STAGES, ON_GPU)
        w0 = _ahead(wgu, 2 * INTER, H, pid, G, 2, BLOCK_N, BLOCK_K, STAGES, ON_GPU)
        _barrier(cnt_ptr, j + 1, G, SYNC, times_ptr, TIMES)
        _stage(wgu, 2 * INTER, H, hg_ptr, _rstd(h_ptr, H, eps), act_ptr, hg_ptr, g2_ptr, pid, G, w0, True, False,
               BLOCK_N, BLOCK_K, STAGES, ON_GPU)
        w0 = _ahead(wd, H, INTER, pid, G, 1, BN_O, BK_O, STAGES, ON_GPU)
        _barrier(cnt_ptr, j + 2, G, SYNC, times_ptr, TIMES)
        _stage(wd, H, INTER, act_ptr, 1.0, h_ptr, hg_ptr, g1_ptr, pid, G, w0, False, True, BN_O, BK_O, STAGES, ON_GPU)
        w0 = _ahead(wqkv + QKV * H, QKV, H, pid, G, 1, BLOCK_N, BLOCK_K, STAGES, ON_GPU)  # the spare layer past
        _barrier(cnt_ptr, j + 3, G, SYNC, times_ptr, TIMES)                                       # the last: never stored, only read


def resident(kernel, warps: int) -> int:
    """How many programs of a compiled ``kernel`` fit on the GPU at once: per SM the least of its
    shared memory, registers and 32 warps' worth, times the SMs."""
    if getattr(kernel, "n_regs", None) is None:
        kernel._init_handles()          # triton loads the module (and reads its register count) lazily
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) - 1024
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    per_sm = min(smem // max(kernel.metadata.shared, 1), regs // max(kernel.n_regs * 32 * warps, 1), 64 // warps)
    return per_sm * props.multi_processor_count


class Layers:
    """Random bf16 weights of ``layers`` layers of one shape (plus one spare layer the last prefetch
    reads), the float32 residual and the scratch rows."""

    def __init__(self, shape: tuple[int, int, int], layers: int, device):
        h, q, inter = shape
        self.shape, self.layers = shape, layers

        def w(n, k):
            return torch.randn(layers + 1, n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
        self.wqkv, self.wo, self.wgu, self.wd = w(q, h), w(h, h), w(2 * inter, h), w(h, inter)
        self.g1 = 1 + 0.1 * torch.randn(h, device=device, dtype=torch.bfloat16)
        self.g2 = 1 + 0.1 * torch.randn(h, device=device, dtype=torch.bfloat16)
        self.h0 = torch.randn(h, device=device, dtype=torch.float32)
        self.h = self.h0.clone()
        self.hg = torch.zeros(h, device=device, dtype=torch.bfloat16)
        self.qkv = torch.zeros(q, device=device, dtype=torch.bfloat16)
        self.act = torch.zeros(inter, device=device, dtype=torch.bfloat16)
        self.counts = torch.zeros(4 * layers, device=device, dtype=torch.int32)

    def nbytes(self) -> int:
        """Weight bytes of one layer."""
        return sum(t[0].numel() * t.element_size() for t in (self.wqkv, self.wo, self.wgu, self.wd))

    def reset(self) -> None:
        """``h`` back to ``h0`` and ``hg`` to ``h0 ⊙ g₁``."""
        self.h.copy_(self.h0)
        self.hg.copy_((self.h0 * self.g1.float()).bfloat16())

    def check_tiles(self, block_n: int, block_k: int, narrow: int) -> None:
        """``ValueError`` unless ``BLOCK_K`` (times 2 for the o and down projections with ``narrow``)
        divides the hidden and intermediate sizes and ``BLOCK_N`` leaves at least two rows a tile."""
        h, _, inter = self.shape
        if h % (block_k << narrow) or inter % (block_k << narrow):
            raise ValueError(f"BLOCK_K must divide the hidden size {h} and the intermediate size {inter}, got "
                             f"{block_k} (x{1 << narrow} for the narrow projections)")
        if (block_n >> narrow) < 2:
            raise ValueError(f"BLOCK_N must be at least {2 << narrow}, got {block_n}")

    def persistent(self, programs: int, block_n: int, block_k: int, warps: int, stages: int = 0, *,
                   narrow: int = 0, sync: int = 1, times: torch.Tensor | None = None) -> None:
        """Launch :func:`_layers` once (counters zeroed first); ``stages`` > 0: the pipelined
        ``tl.dot`` loop that deep, else the register FMA loop; ``narrow``, ``sync``: its ``NARROW``
        and ``SYNC``; ``times``: int64 ``[4 · layers, programs, 2]`` to take :func:`_barrier`'s timer
        readings. On a GPU the grid must be resident at once (every barrier waits for all of
        it): more programs than fit raise ``ValueError``."""
        h, q, inter = self.shape
        self.check_tiles(block_n, block_k, narrow)
        args = (self.h, self.hg, self.qkv, self.act, self.g1, self.g2, self.wqkv, self.wo, self.wgu, self.wd,
                self.counts, self.counts if times is None else times, self.layers, EPS)
        meta = dict(H=h, QKV=q, INTER=inter, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, ON_GPU=self.h.is_cuda,
                    NARROW=narrow, SYNC=sync, TIMES=times is not None, num_warps=warps)
        if self.h.is_cuda:
            fits = resident(_layers.warmup(*args, grid=(programs,), **meta), warps)
            if programs > fits:
                raise ValueError(f"{programs} programs do not fit the GPU at once ({fits} do): a barrier would hang")
        self.counts.zero_()
        _layers[(programs,)](*args, **meta)

    def reference(self) -> torch.Tensor:
        """The module docstring's chain in float32 torch from ``h0`` (activations rounded to bf16 where
        the kernel stores them)."""
        h, q, inter = self.shape
        x = self.h0.clone()
        for i in range(self.layers):
            def norm(v, g):
                return v * torch.rsqrt(v.pow(2).mean() + EPS) * g.float()
            qkv = (self.wqkv[i].float() @ norm(x, self.g1)).bfloat16()
            x = x + self.wo[i].float() @ qkv[:h].float()
            gu = (self.wgu[i].float() @ norm(x, self.g2)).view(inter, 2)
            a = (torch.nn.functional.silu(gu[:, 0]) * gu[:, 1]).bfloat16()
            x = x + self.wd[i].float() @ a.float()
        return x


def engine_chain(lay: Layers):
    """The same projections through the engine's decode GEMV, one launch each (no norms)."""
    from graphdsl.runtime.kernels.gemv import GemvWorkspace, gemv
    h, q, inter = lay.shape
    hid = [torch.randn(1, h, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    qkv = torch.zeros(1, q, device="cuda", dtype=torch.bfloat16)
    act = torch.zeros(1, inter, device="cuda", dtype=torch.bfloat16)
    ws = GemvWorkspace()

    def run():
        for i in range(lay.layers):
            gemv(hid[0], lay.wqkv[i], out=qkv, workspace=ws)
            gemv(qkv[:, :h], lay.wo[i], add=hid[0], out=hid[1], workspace=ws)
            gemv(hid[1], lay.wgu[i], silu_mul=True, out=act, workspace=ws)
            gemv(act, lay.wd[i], add=hid[1], out=hid[0], workspace=ws)
    return run


def _config(text: str) -> tuple[int, int, int, int]:
    try:
        parts = [int(v) for v in text.lower().split("x")]
        if len(parts) not in (3, 4):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK_NxBLOCK_KxWARPS[xSTAGES] like 16x512x8 or 32x256x4x5, "
                                         f"got {text!r}") from None
    bn, bk, warps, stages = parts + [0] * (4 - len(parts))
    if stages < 0:
        raise argparse.ArgumentTypeError(f"STAGES must be at least 0, got {stages} in {text!r}")
    for name, v in (("BLOCK_N", bn), ("BLOCK_K", bk), ("WARPS", warps)):
        if v < 1 or v & (v - 1):
            raise argparse.ArgumentTypeError(f"{name} must be a power of two, got {v} in {text!r}")
    if bn < 2:
        raise argparse.ArgumentTypeError(f"BLOCK_N must be at least 2 (gate/up pairs), got {bn} in {text!r}")
    return bn, bk, warps, stages


def _ints(low: int, high: int | None = None):
    def parse(text: str) -> list[int]:
        try:
            vals = [int(v) for v in text.split(",")]
        except ValueError:
            vals = []
        if not vals or min(vals) < low or (high is not None and max(vals) > high):
            want = f"integers from {low} to {high}" if high is not None else f"integers >= {low}"
            raise argparse.ArgumentTypeError(f"expected comma-separated {want}, got {text!r}")
        return vals
    return parse


POLLS = {1: "atomic", 2: "load"}


def _polls(text: str) -> list[int]:
    names = {v: k for k, v in POLLS.items()}
    for n in text.split(","):
        if n not in names:
            raise argparse.ArgumentTypeError(f"expected names from {sorted(names)}, got {n!r}")
    return [names[n] for n in text.split(",")]


def barrier_spread(times: torch.Tensor) -> dict[str, tuple[float, float, float, float]]:
    """From :func:`_barrier`'s readings ``[4 · layers, G, 2]`` (ns): per projection ending at the
    barrier, the mean over layers of (the projection's median stream: median arrival - median
    departure from the barrier before; last - first arrival; last - median arrival; median
    departure - last arrival), µs. The first projection of the launch has no barrier before it and
    is left out of the stream's mean."""
    t = times.double()
    arrive, leave = t[..., 0], t[..., 1]
    last = arrive.max(dim=1).values
    med_leave = leave.median(dim=1).values
    stream = arrive.median(dim=1).values[1:] - med_leave[:-1]
    cols = (last - arrive.min(dim=1).values, last - arrive.median(dim=1).values, med_leave - last)
    out = {}
    for i, proj in enumerate(("qkv", "o", "gate_up", "down")):
        s = stream[(i + 3) % 4::4]          # stream[j - 1] is projection j's
        out[proj] = (s.mean().item() / 1e3,) + tuple(c[i::4].mean().item() / 1e3 for c in cols)
    return out


def _shapes(text: str) -> list[str]:
    names = text.split(",")
    for n in names:
        if n not in SHAPES:
            raise argparse.ArgumentTypeError(f"expected names from {sorted(SHAPES)}, got {n!r}")
    return names


def start_table(script: str, layers: int):
    """Say what ``script`` runs on and print its table's header: ``(SMs, copy GB/s)``, or None
    (after saying so on stderr) without a CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth_gbs()
    print(device_line() + f"; copy bandwidth {copy:.0f} GB/s; {sms} SMs; {layers} layers a step\n")
    print("| shape | chain | µs a layer | bytes at copy bandwidth, µs | % of copy | over bytes, µs |")
    print("|---|---|---:|---:|---:|---:|")
    return sms, copy


def shape_rows(name: str, layers: int, copy: float):
    """Shape ``name``'s :class:`Layers`, a printer of its rows ``row(label, µs a layer)`` (the
    engine's chain's row printed first), and two layers with their float32 reference to check a
    loop against before it is timed."""
    lay = Layers(SHAPES[name], layers, "cuda")
    at_copy = lay.nbytes() / (copy * 1e9) * 1e6

    def row(label, us):
        print(f"| {name} | {label} | {us:.1f} | {at_copy:.1f} | {100 * at_copy / us:.1f} | {us - at_copy:.1f} |",
              flush=True)
    row("engine GEMVs, a launch each (PDL)", graph_ms(engine_chain(lay)) * 1e3 / layers)
    small = Layers(SHAPES[name], 2, "cuda")
    return lay, row, small, small.reference()


def chain_arguments(doc: str, configs: list, configs_help: str, narrow: list) -> argparse.ArgumentParser:
    """The arguments persistent.py and dataflow.py share: ``--layers``, ``--shapes``, ``--configs``
    (``configs`` by default), ``--per-sm`` and ``--narrow`` (``narrow`` by default)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=at_least(1), default=32, help="layers a step (default 32)")
    ap.add_argument("--shapes", type=_shapes, default=["8b", "1b"], help="comma-separated: 8b, 1b")
    ap.add_argument("--configs", type=lambda s: [_config(c) for c in s.split(",")], default=configs,
                    help=configs_help + " (default " + ",".join("x".join(str(v) for v in c if v) for c in configs) + ")")
    ap.add_argument("--per-sm", type=_ints(1), default=[1],
                    help="programs a SM, comma-separated (default 1; all must be resident at once)")
    ap.add_argument("--narrow", type=_ints(0, 1), default=narrow,
                    help="0 and/or 1: the o and down projections in [BLOCK_N/2, 2 BLOCK_K] tiles (default "
                         + ",".join(map(str, narrow)) + ")")
    return ap


def main(argv=None) -> int:
    ap = chain_arguments(__doc__, [(32, 512, 8, 0), (16, 256, 4, 5)],
                         "persistent loops, comma-separated BLOCK_NxBLOCK_KxWARPS[xSTAGES]: with STAGES the "
                         "pipelined tl.dot loop that deep, without it the register FMA loop", [1])
    ap.add_argument("--without-barriers", action="store_true",
                    help="also time each loop with the barriers left out (the streams alone; results wrong)")
    ap.add_argument("--poll", type=_polls, default=[2],
                    help="how a barrier polls, comma-separated: atomic (adds of 0), load (load-acquires; default)")
    ap.add_argument("--barrier-times", action="store_true",
                    help="also read the timer at every barrier and print how the programs arrive and leave")
    args = ap.parse_args(argv)
    spreads = []
    started = start_table("persistent.py", args.layers)
    if started is None:
        return 2
    sms, copy = started
    for name in args.shapes:
        lay, row, small, want = shape_rows(name, args.layers, copy)
        for per_sm, narrow, (bn, bk, warps, stages), poll in itertools.product(args.per_sm, args.narrow,
                                                                               args.configs, args.poll):
            loop = f"tl.dot {stages} stages" if stages else "FMA"
            label = (f"persistent {bn}x{bk}{' (o, down halved)' if narrow else ''} {loop}, {warps} warps, {per_sm}/SM, "
                     f"{POLLS[poll]} polls")
            launch = functools.partial(lay.persistent, sms * per_sm, bn, bk, warps, stages, narrow=narrow, sync=poll)
            small.reset()
            try:
                small.persistent(sms * per_sm, bn, bk, warps, stages, narrow=narrow, sync=poll)
            except ValueError as e:
                print(f"| {name} | {label} | skipped: {e} | | | |", flush=True)
                continue
            err = ((small.h - want).norm() / want.norm()).item()
            if not err < 1e-2:
                print(f"| {name} | {label} | wrong: relative error {err:.3g} | | | |", flush=True)
                continue
            row(label, graph_ms(launch) * 1e3 / args.layers)
            if args.barrier_times:
                times = torch.zeros(4 * args.layers, sms * per_sm, 2, dtype=torch.int64, device="cuda")
                launch(times=times)
                torch.cuda.synchronize()
                spreads.append((name, label, barrier_spread(times)))
        if args.without_barriers:
            for per_sm, narrow, (bn, bk, warps, stages) in itertools.product(args.per_sm, args.narrow, args.configs):
                label = f"persistent {bn}x{bk}{' (o, down halved)' if narrow else ''}, {per_sm}/SM, no barriers"
                try:
                    us = graph_ms(functools.partial(lay.persistent, sms * per_sm, bn, bk, warps, stages, narrow=narrow,
                                                    sync=0)) * 1e3 / args.layers
                except ValueError as e:
                    print(f"| {name} | {label} | skipped: {e} | | | |", flush=True)
                    continue
                row(label + " (timing only: results wrong)", us)
        del lay, small
        torch.cuda.empty_cache()
    if spreads:
        print("\nBarrier timer readings (%globaltimer, one launch), µs, mean over the layers: a projection's "
              "median stream (median arrival at its barrier - median departure from the one before), the spread "
              "of the programs' arrivals (last - first), the wait for the last (last - median), and the release "
              "(median departure - last arrival)\n")
        print("| shape | loop | projection | median stream | arrival spread | last - median | release |")
        print("|---|---|---|---:|---:|---:|---:|")
        for name, label, table in spreads:
            for proj, vals in table.items():
                print(f"| {name} | {label} | {proj} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
