"""Probe: does moving a tensor-parallel all-reduce into the GEMVs around it pay?

    python3 benchmarks/tp_fusion.py [--world 2] [--layers 32]      # needs 2 GPUs

A TP2 decode layer of the Llama-3-8B shape sums two partial rows a layer, after the o and the down
projections, then adds the residual and normalises. Today that is a kernel of its own between two
GEMVs (``runtime/kernels/allreduce.py``: the GEMV ends, the one-shot kernel pushes the row to the
peer, waits for the peer's, sums and normalises, then the next GEMV starts); on two H200s it ends
5-7 µs after the GEMV it follows (docs/distributed.md). The chain timed here against it:

* **push** (the producer GEMV, o or down): each program computes its tile of the partial output and
  stores it straight into every rank's buffer (region ``[slot, RANK]``, its own rank's included),
  then adds 1 to every rank's arrival counter (a system-scope release atomic);
* **sum + norm + GEMV** (the consumer, gate|up or qkv): each program waits until its rank's counter
  has every tile of the call from every rank (``call · tiles · W``, acquire polls), sums the ``W``
  partial rows in rank order in float32, adds the residual, normalises (program 0 stores the new
  residual), and runs its GEMV rows over the normalised row.

No launch of its own is left for the all-reduce; what remains is the counter's trip over NVLink.
A call site owns its buffers (two slots, as the one-shot kernel's), its counter and its programs'
call counters; a rank writes a slot again two calls later, after its peers' consumers of the call
between have run, so one exchange a call is enough. The kernels use PDL as the engine's: the
consumer does not wait for the producer's grid (it waits for the counter instead), everything else
does.

Prints µs a layer for the two chains (two GEMVs and one sum a site, two sites a layer: o → gate|up,
down → qkv; attention and the activation left out), captured ``--layers`` deep in a CUDA graph on
each rank and replayed, with the layer's weight bytes over the copy bandwidth beside them; the
chains' outputs are compared first. Both chains run the same plain GEMV (not the engine's tuned
one), so their difference is what the fusion changes. Not wired into the engine: a measurement of
whether it should be.
"""
from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graphdsl.runtime.kernels.allreduce import _wait_for  # noqa: E402
from graphdsl.runtime.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait  # noqa: E402

HIDDEN, INTER, HEADS_DIM, KV_DIM = 4096, 14336, 4096, 1024      # the Llama-3-8B shape
BLOCK_N, BLOCK_K = 16, 256
ONE_SHOT, FUSED = "GEMV, one-shot sum + norm, GEMV", "push GEMV, sum + norm + GEMV"      # the two chains


@triton.jit
def _rows_dot(x_ptr, w_ptr, rows, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 ``W[rows, :] @ x`` (``W [N, K]`` row-major, ``x [K]``)."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < N) & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``y = W @ x``: the chains' plain GEMV."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pdl_wait(USE_PDL)
    acc = _rows_dot(x_ptr, w_ptr, rows, N, K, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _count(ptr, ON_GPU: tl.constexpr):
    """Add 1 to the int64 at ``ptr`` (any rank's memory), release at system scope."""
    if ON_GPU:
        tl.atomic_add(ptr, 1, sem="release", scope="sys")
    else:
        tl.atomic_add(ptr, 1, sem="release")


@triton.jit
def _push_gemv_kernel(x_ptr, w_ptr, buf_ptrs, cnt_ptrs, epoch_ptr, N, K, REGION, RANK: tl.constexpr,
                      W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ON_GPU: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """The producer: this rank's partial tile of ``W @ x`` into region ``[slot, RANK]`` of every
    rank's buffer, then one count on every rank's counter."""
    p = tl.program_id(0)
    rows = p * BLOCK_N + tl.arange(0, BLOCK_N)
    pdl_wait(USE_PDL)
    e = tl.load(epoch_ptr + p) + 1
    slot = e % 2
    y = _rows_dot(x_ptr, w_ptr, rows, N, K, BLOCK_N, BLOCK_K)
    for q in tl.static_range(W):
        dst = tl.load(buf_ptrs + q).to(tl.pointer_type(x_ptr.dtype.element_ty))
        tl.store(dst + (slot * W + RANK) * REGION + rows, y.to(x_ptr.dtype.element_ty), mask=rows < N)
    tl.debug_barrier()                          # the whole tile is out before the counts
    for q in tl.static_range(W):
        _count(tl.load(cnt_ptrs + q).to(tl.pointer_type(tl.int64)), ON_GPU)
    tl.store(epoch_ptr + p, e)


@triton.jit
def _norm_gemv_kernel(buf_ptrs, cnt_ptrs, epoch_ptr, res_ptr, sum_ptr, nw_ptr, scratch_ptr, w_ptr, out_ptr,
                      H, N, TILES, REGION, eps, RANK: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ON_GPU: tl.constexpr, USE_PDL: tl.constexpr):
    """The consumer: wait for every rank's tiles of the call, ``s = Σ_r part_r + residual``,
    ``normed = nw · s · rsqrt(mean(s²) + eps)``, then ``out[rows] = W[rows] @ normed``."""
    p = tl.program_id(0)
    dt = res_ptr.dtype.element_ty
    e = tl.load(epoch_ptr + p) + 1
    slot = e % 2
    _wait_for(tl.load(cnt_ptrs + RANK).to(tl.pointer_type(tl.int64)), e * TILES * W, ON_GPU)
    own = tl.load(buf_ptrs + RANK).to(tl.pointer_type(dt))
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for r in tl.static_range(W):
        acc += tl.load(own + (slot * W + r) * REGION + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    s = (acc.to(dt).to(tl.float32) + tl.load(res_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
    sf = s.to(tl.float32)
    normed = (sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)).to(dt)
    normed = (tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(dt)
    if p == 0:
        tl.store(sum_ptr + cols, s, mask=ok)
    tl.store(scratch_ptr + cols, normed, mask=ok)       # every program stores the same row
    tl.debug_barrier()
    rows = p * BLOCK_N + tl.arange(0, BLOCK_N)
    out = _rows_dot(scratch_ptr, w_ptr, rows, N, H, BLOCK_N, BLOCK_K)
    pdl_trigger(USE_PDL)
    tl.store(out_ptr + rows, out.to(dt), mask=rows < N)
    tl.store(epoch_ptr + p, e)


class Site:
    """One all-reduce site's state on one rank: the peer-mapped buffers' and counters' pointers
    (int64 ``[W]``), the producer's and consumer's per-program call counters, and the region (a
    ``[slot, rank]`` area's elements: the row width)."""

    def __init__(self, buf_ptrs: torch.Tensor, cnt_ptrs: torch.Tensor, rank: int, world: int, region: int,
                 keep: tuple):
        device = buf_ptrs.device
        self.buf_ptrs, self.cnt_ptrs, self.rank, self.world, self.region = buf_ptrs, cnt_ptrs, rank, world, region
        self.produced = torch.zeros(4096, dtype=torch.int64, device=device)
        self.consumed = torch.zeros(4096, dtype=torch.int64, device=device)
        self.keep = keep             # the buffers the pointers point into


def push_gemv(x: torch.Tensor, w: torch.Tensor, site: Site) -> None:
    """Producer: this rank's ``w @ x`` (``w [H, K]``) into every rank's buffer of ``site``."""
    n, k = w.shape
    _push_gemv_kernel[(triton.cdiv(n, BLOCK_N),)](x, w, site.buf_ptrs, site.cnt_ptrs, site.produced, n, k,
                                                   site.region, RANK=site.rank, W=site.world, BLOCK_N=BLOCK_N,
                                                   BLOCK_K=BLOCK_K, ON_GPU=x.is_cuda, **pdl_launch(x.device))


def norm_gemv(site: Site, residual: torch.Tensor, new_residual: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor,
              out: torch.Tensor, scratch: torch.Tensor, eps: float = 1e-5) -> None:
    """Consumer: ``new_residual = residual + Σ_ranks part`` and ``out = w @ rms_norm(new_residual) · norm_w``
    (``new_residual`` another buffer: the programs read ``residual`` while program 0 writes)."""
    h = residual.numel()
    n = w.shape[0]
    _norm_gemv_kernel[(triton.cdiv(n, BLOCK_N),)](site.buf_ptrs, site.cnt_ptrs, site.consumed, residual, new_residual,
                                                   norm_w, scratch, w, out, h, n, triton.cdiv(h, BLOCK_N),
                                                   site.region, float(eps), RANK=site.rank, W=site.world,
                                                   BLOCK_H=triton.next_power_of_2(h), BLOCK_N=BLOCK_N,
                                                   BLOCK_K=BLOCK_K, ON_GPU=residual.is_cuda,
                                                   **pdl_launch(residual.device))


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """``y = w @ x``."""
    n, k = w.shape
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](x, w, y, n, k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **pdl_launch(x.device))


def local_sites(world: int, h: int, dtype, device) -> list[Site]:
    """``world`` ranks' :class:`Site` over buffers of this process (ranks run one after another
    under the interpreter, as the tests do)."""
    bufs = [torch.zeros(2 * world * h, dtype=dtype, device=device) for _ in range(world)]
    cnts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    cnt_ptrs = torch.tensor([c.data_ptr() for c in cnts], dtype=torch.int64, device=device)
    return [Site(buf_ptrs, cnt_ptrs, r, world, h, (bufs, cnts)) for r in range(world)]


def _peer_site(h: int, dtype, device) -> Site:
    """This rank's :class:`Site` over buffers mapped into every rank of the default group
    (:func:`graphdsl.runtime.distributed.ipc.peer_pointers`, as the one-shot all-reduce's)."""
    import torch.distributed as dist

    from graphdsl.runtime.distributed.ipc import peer_pointers
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.empty(2 * world * h, dtype=dtype, device=device)
    cnt = torch.zeros(1, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    return Site(peer_pointers(buf, rank, world), peer_pointers(cnt, rank, world), rank, world, h, (buf, cnt))


class Layer:
    """One rank's TP layer stand-in: its o, gate|up, down and qkv slices (random) and two norm weights."""

    def __init__(self, world: int, device, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)

        def w(n, k):
            return (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
        self.o = w(HIDDEN, HEADS_DIM // world)
        self.gate_up = w(2 * INTER // world, HIDDEN)
        self.down = w(HIDDEN, INTER // world)
        self.qkv = w((HEADS_DIM + 2 * KV_DIM) // world, HIDDEN)
        self.norms = [torch.ones(HIDDEN, dtype=torch.bfloat16, device=device) for _ in range(2)]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.o, self.gate_up, self.down, self.qkv))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args(argv)
    if args.world < 2 or args.layers < 1:
        ap.error(f"--world must be at least 2 and --layers at least 1, got {args.world} and {args.layers}")
    if not torch.cuda.is_available():
        print(f"tp_fusion.py needs a CUDA GPU ({args.world} of them)", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < args.world:
        print(f"tp_fusion.py needs {args.world} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])      # the ranks inherit it
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank_main, args=(args.world, args.layers, results), nprocs=args.world, start_method="spawn")
    row = results.get()
    print(f"# TP{args.world} layer chain, Llama-3-8B shape, bf16 — {row['device']}; copy {row['copy']:.0f} GB/s")
    print("| chain | µs a layer | weight bytes at copy bandwidth, µs | over the bytes |")
    print("|---|---:|---:|---:|")
    for name in (ONE_SHOT, FUSED):
        us = row[name]
        print(f"| {name} | {us:.1f} | {row['bytes_us']:.1f} | {us - row['bytes_us']:+.1f} |")
    print(f"\noutputs of the two chains: max |difference| {row['diff']:.3g}")
    return 0


def _rank_main(rank: int, world: int, layers: int, results) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import copy_bandwidth_gbs, device_line

    from graphdsl.runtime.distributed import init_distributed
    from graphdsl.runtime.distributed.collectives import _peers
    from graphdsl.runtime.kernels.allreduce import one_shot_all_reduce
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    ctx = init_distributed(rank, world, torch.device("cuda", rank))
    dev = ctx.device
    nets = [Layer(world, dev, seed=1000 * i + rank) for i in range(layers)]
    sites = [_peer_site(HIDDEN, torch.bfloat16, dev) for _ in range(2)]
    peers = _peers(dist, dev, torch.bfloat16, HIDDEN * 2 * 64)
    bf = dict(dtype=torch.bfloat16, device=dev)
    x0 = (torch.randn(HEADS_DIM // world, generator=torch.Generator(device=dev).manual_seed(7), device=dev)).to(**bf)
    res0 = torch.randn(HIDDEN, generator=torch.Generator(device=dev).manual_seed(8), device=dev).to(**bf)
    part, normed = torch.empty(HIDDEN, **bf), torch.empty(HIDDEN, **bf)
    gu = torch.empty(2 * INTER // world, **bf)
    qkv = torch.empty((HEADS_DIM + 2 * KV_DIM) // world, **bf)
    scratch = [torch.empty(HIDDEN, **bf) for _ in range(2)]
    res = [torch.empty(HIDDEN, **bf) for _ in range(2)]       # a site reads one, writes the other

    def oneshot_chain():
        x = x0
        for net in nets:
            for site, (w_in, w_out, out) in enumerate(((net.o, net.gate_up, gu), (net.down, net.qkv, qkv))):
                gemv(x, w_in, part)
                one_shot_all_reduce(part.view(1, -1), peers, normed.view(1, -1), residual=res[site].view(1, -1),
                                    weight=net.norms[site], sum_out=res[1 - site].view(1, -1))
                gemv(normed, w_out, out)
                x = out[: INTER // world] if site == 0 else out[: HEADS_DIM // world]

    def fused_chain():
        x = x0
        for net in nets:
            for site, (w_in, w_out, out) in enumerate(((net.o, net.gate_up, gu), (net.down, net.qkv, qkv))):
                push_gemv(x, w_in, sites[site])
                norm_gemv(sites[site], res[site], res[1 - site], net.norms[site], w_out, out, scratch[site])
                x = out[: INTER // world] if site == 0 else out[: HEADS_DIM // world]

    chains = {ONE_SHOT: oneshot_chain, FUSED: fused_chain}
    outs = {}
    for name, chain in chains.items():
        res[0].copy_(res0)
        chain()
        torch.cuda.synchronize(dev)
        outs[name] = qkv.float().clone()
    row = {"diff": (outs[ONE_SHOT] - outs[FUSED]).abs().max().item()}
    for name, chain in chains.items():
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            chain()
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.cuda.graph(graph):
            chain()
        dist.barrier()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(10):
                graph.replay()
            b.record()
            torch.cuda.synchronize(dev)
            times.append(a.elapsed_time(b) * 1e3 / 10 / layers)
        row[name] = sorted(times)[len(times) // 2]
        del graph
    if rank == 0:
        copy = copy_bandwidth_gbs()
        row.update(device=device_line(), copy=copy, bytes_us=nets[0].bytes() / (copy * 1e9) * 1e6)
        results.put(row)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
