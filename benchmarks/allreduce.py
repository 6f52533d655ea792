"""Small-message all-reduce on 2 GPUs: NCCL against the one-shot symmetric-memory path graphdsl can
lower ``all_reduce`` to (``GRAPHDSL_ALLREDUCE=symm_mem``), through the engine's own lowering.

    python3 benchmarks/allreduce.py [--world 2] [--kib 8 16 32 64 128 256 512]

Per size and path, µs per all-reduce two ways: *eager*, the median of CUDA-event timings of 200
back-to-back calls from Python (5 rounds; for small messages this is the host's launch rate, not the
GPUs'), and *graph*, 64 calls captured in one CUDA graph and replayed (median of 5 rounds of 20
replays) — what a decode step's all-reduces cost, since decode graphs capture them. Bus bandwidth
``2 (W - 1) / W · bytes / time`` from the graph time. Decode all-reduces are ``hidden_size × 2``
bytes per token (8 KiB for an 8B model at batch 1). NVLink multicast stays off (set here before
torch loads).

A second table times what a tensor-parallel layer runs after its o and down projections, rows of
4096 (``kib / 8`` tokens), graph-replayed: the all-reduce and then the ``add_rms_norm`` kernel
(NCCL, or the one-shot path), against the one-shot launch that also adds and normalises
(``collectives.all_reduce_add_rms_norm``, checked against the first).
"""
from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _time_us(fn, iters: int = 200, rounds: int = 5) -> float:
    """µs per ``fn()``: the median over ``rounds`` of ``iters`` back-to-back calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(out)


def _graph_us(fn, per_graph: int = 64, replays: int = 20, rounds: int = 5) -> float:
    """µs per ``fn()`` with ``per_graph`` calls captured in one CUDA graph (warmed on a side stream
    first, as capture requires), replayed; the graph is dropped before returning (a graph that
    captured NCCL calls holds the communicator until it is destroyed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    us = _time_us(graph.replay, iters=replays, rounds=rounds) / per_graph
    del graph
    torch.cuda.synchronize()
    return us


def _rank(rank: int, world: int, sizes_kib: list[int]):
    from graphdsl.runtime.distributed import collectives, init_distributed
    ctx = init_distributed(rank, world, torch.device("cuda", rank))
    lower = collectives.COLLECTIVE_LOWERINGS["all_reduce"]
    rows = []
    for kib in sizes_kib:
        x = torch.randn(kib * 512, dtype=torch.bfloat16, device=ctx.device)
        dst = torch.empty_like(x)
        times = {}
        for mode in ("nccl", "symm_mem"):
            os.environ["GRAPHDSL_ALLREDUCE"] = mode
            os.environ["GRAPHDSL_ONESHOT_MAX_BYTES"] = str(max(sizes_kib) * 1024)
            call = lambda: lower(None, None, [x], {"world_size": world}, [dst])  # noqa: E731
            times[mode] = (_time_us(call), _graph_us(call))
            ref = x.clone()
            torch.distributed.all_reduce(ref)
            torch.testing.assert_close(dst, ref)
        rows.append((kib, times["nccl"], times["symm_mem"]))
    torch.distributed.barrier()
    return rows, _with_norm(ctx.device, world, [k for k in sizes_kib if k % 8 == 0])


def _with_norm(device, world: int, sizes_kib: list[int]) -> list:
    """µs (graph) of all-reduce + ``add_rms_norm`` launched apart (NCCL, one-shot) and fused, per
    size of rows of 4096; the fused outputs are checked against the one-shot-then-norm ones."""
    from graphdsl.runtime.codegen.ops import add_rms_norm
    from graphdsl.runtime.distributed import collectives
    lower = collectives.COLLECTIVE_LOWERINGS["all_reduce"]
    out = []
    for kib in sizes_kib:
        m = kib * 512 // 4096
        x = torch.randn(m, 4096, dtype=torch.bfloat16, device=device)
        res = torch.randn_like(x)
        w = (1 + 0.1 * torch.randn(4096, device=device)).bfloat16()
        y, normed, s = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        fused_normed, fused_s = torch.empty_like(x), torch.empty_like(x)

        def apart():
            lower(None, None, [x], {"world_size": world}, [y])
            add_rms_norm(y, res, w, eps=1e-5, out=normed, residual_out=s)

        def fused():
            assert collectives.all_reduce_add_rms_norm(x, res, w, 1e-5, fused_normed, fused_s, world)
        times = []
        for mode, fn in (("nccl", apart), ("symm_mem", apart), ("symm_mem", fused)):
            os.environ["GRAPHDSL_ALLREDUCE"] = mode
            times.append(_graph_us(fn))
        torch.testing.assert_close(fused_s, s, rtol=0, atol=0)
        torch.testing.assert_close(fused_normed.float(), normed.float(), rtol=2 ** -7, atol=1e-3)
        out.append((kib, m, *times))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kib", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512])
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"allreduce.py needs {args.world} CUDA GPUs", file=sys.stderr)
        return 2
    from tests.helpers.tp_ranks import run_ranks
    rows, normed = run_ranks(args.world, _rank, args.kib, timeout_s=600)
    w = args.world
    print(f"# all-reduce, {w} GPUs ({torch.cuda.get_device_name()}), bf16")
    print("| KiB | NCCL µs, eager | one-shot µs, eager | NCCL µs, graph | one-shot µs, graph | NCCL bus GB/s, graph "
          "| one-shot bus GB/s, graph | one-shot speed-up, graph |")
    print("|---|---|---|---|---|---|---|---|")
    for kib, (nccl_e, nccl_g), (one_e, one_g) in rows:
        bus = 2 * (w - 1) / w * kib * 1024 / 1e3
        print(f"| {kib} | {nccl_e:.1f} | {one_e:.1f} | {nccl_g:.2f} | {one_g:.2f} | {bus / nccl_g:.1f} | "
              f"{bus / one_g:.1f} | {nccl_g / one_g:.2f}x |")
    print(f"\n# all-reduce + add + RMSNorm, rows of 4096, {w} GPUs, bf16, µs a pair (CUDA graph)")
    print("| KiB | rows | NCCL, then the norm kernel | one-shot, then the norm kernel | one-shot with the norm, "
          "one launch | fused vs NCCL |")
    print("|---|---|---|---|---|---|")
    for kib, m, nccl, apart, fused in normed:
        print(f"| {kib} | {m} | {nccl:.2f} | {apart:.2f} | {fused:.2f} | {nccl / fused:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
