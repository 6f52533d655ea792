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
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kib", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512])
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"allreduce.py needs {args.world} CUDA GPUs", file=sys.stderr)
        return 2
    from tests.helpers.tp_ranks import run_ranks
    rows = run_ranks(args.world, _rank, args.kib, timeout_s=600)
    w = args.world
    print(f"# all-reduce, {w} GPUs ({torch.cuda.get_device_name()}), bf16")
    print("| KiB | NCCL µs, eager | one-shot µs, eager | NCCL µs, graph | one-shot µs, graph | NCCL bus GB/s, graph "
          "| one-shot bus GB/s, graph | one-shot speed-up, graph |")
    print("|---|---|---|---|---|---|---|---|")
    for kib, (nccl_e, nccl_g), (one_e, one_g) in rows:
        bus = 2 * (w - 1) / w * kib * 1024 / 1e3
        print(f"| {kib} | {nccl_e:.1f} | {one_e:.1f} | {nccl_g:.2f} | {one_g:.2f} | {bus / nccl_g:.1f} | "
              f"{bus / one_g:.1f} | {nccl_g / one_g:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
