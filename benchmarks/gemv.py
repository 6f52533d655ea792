"""Decode GEMV (runtime/kernels/gemv.py) against cuBLAS on the projections of real shapes.

    python benchmarks/gemv.py [--sweep] [--rows 1,16] [--only 8b.o,1b.down] [--mid-rows 32,64,128,256]

For each projection weight [N, K] of Llama-3-8B and Llama-3.2-1B and each row count M: checks the
kernel against a float32 ``x @ w.T`` and prints µs and the % of the copy bandwidth (measured in
the same run) that the weight + rows + output bytes over that time make, for cuBLAS
(``torch.matmul``) and for the kernel with its launch heuristic.

Timing is how decode runs them: one CUDA graph replays the projection over enough copies of the
weight to overflow L2 (each launch reads its weight from HBM, as every layer's does in a decode
step), and the time per launch is the replay time over the copies, so launch gaps inside a graph
are included. ``--sweep`` also times a grid of launches per shape and M and prints the best, to
tune ``_pick_config``. A second table times the gate/up projections with the SwiGLU in the GEMV's
epilogue (``gemv(..., silu_mul=True)``, the ``matmul_silu_mul`` op) against the GEMV followed by
the generated ``silu_mul`` kernel, and checks the two give the same bits. A third (``--mid-rows``,
decode batches of 17-256) times the gate/up projections through the tiled SwiGLU GEMM
(``runtime/kernels/swiglu_gemm.py``) against cuBLAS's product then ``silu_mul``, the path it
replaces; with ``--mid-sweep`` it also prints the best launches of a grid.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, device_line  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "8b.lm_head": (128256, 4096), "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048),
          "1b.down": (2048, 8192), "1b.lm_head": (128256, 2048)}


def replay_us(fn, copies: int) -> float:
    """µs per launch: ``fn`` (``copies`` launches) captured in one CUDA graph, median replay time."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3 / copies


def sweep(run, grid, copies: int) -> list[tuple[float, dict]]:
    """``(µs, launch)`` of ``run(launch)`` (``copies`` launches) for every launch of ``grid``, fastest
    first; a launch the compiler rejects (shared memory) is skipped and named."""
    timed = []
    for cfg in grid:
        try:
            timed.append((replay_us(lambda: run(cfg), copies), cfg))
        except Exception as e:  # noqa: BLE001
            print(f"  skipped {cfg}: {type(e).__name__}", flush=True)
    return sorted(timed, key=lambda r: r[0])


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough random [n, k] bf16 weights to hold 4x the L2 between them (2 at least)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    count = max(2, -(-4 * l2 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]


def cases(names: list[str], rows: list[int]):
    """``(name, n, k, weights, m, x)`` per projection shape and row count: the shape's weight copies
    (the list is emptied, freeing them, before the next shape's are made) and random bf16 rows
    ``x [m, k]``."""
    for name in names:
        n, k = SHAPES[name]
        weights = weight_copies(n, k)
        for m in rows:
            yield name, n, k, weights, m, torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights.clear()
        torch.cuda.empty_cache()


def sweep_grid():
    for bn, bk, stages, split, warps in itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 5), (1, 2, 4),
                                                          (2, 4, 8)):
        if bn * bk * 2 * stages <= 160 * 1024:
            yield dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time a grid of launches and print the best")
    ap.add_argument("--rows", default="1,8,16", help="row counts M (comma-separated)")
    ap.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--mid-rows", default="32,64,128,256",
                    help="row counts for the tiled SwiGLU GEMM table (comma-separated; empty: skip it)")
    ap.add_argument("--mid-sweep", action="store_true", help="time a grid of tiled SwiGLU GEMM launches too")
    args = ap.parse_args(argv)
    from graphdsl.runtime.kernels.gemv import GemvWorkspace, _pick_config, gemv
    rows = [int(r) for r in args.rows.split(",")]
    names = [s for s in args.only.split(",") if s] or list(SHAPES)
    copy = copy_bandwidth_gbs()
    print(f"## decode GEMV vs cuBLAS — {device_line()}; copy {copy:.0f} GB/s; CUDA-graph replay, weights from HBM\n")
    print("| weight | M | cuBLAS µs | cuBLAS % copy | gemv µs | gemv % copy | gemv launch | max rel err |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    best_table = {}
    ws = GemvWorkspace()
    for name, n, k, weights, m, x in cases(names, rows):
        c = len(weights)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ weights[0].float().T
        err = ((gemv(x, weights[0], out=out, workspace=ws).float() - want).abs().max() / want.abs().max()).item()
        nbytes = (n * k + m * (n + k)) * 2
        pct = lambda us: 100 * nbytes / (us * 1e-6) / 1e9 / copy  # noqa: E731

        def blas():
            for w in weights:
                torch.matmul(x, w.T, out=out)

        def run(cfg=None):
            for w in weights:
                gemv(x, w, out=out, workspace=ws, config=cfg)
        t_blas, t_gemv = replay_us(blas, c), replay_us(run, c)
        cfg = _pick_config(m, n, k, x.device)
        launch = f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']} split {cfg['SPLIT_K']} st {cfg['num_stages']}"
        print(f"| {name} [{n}, {k}] | {m} | {t_blas:.1f} | {pct(t_blas):.1f}% | {t_gemv:.1f} | "
              f"{pct(t_gemv):.1f}% | {launch} | {err:.1e} |", flush=True)
        if args.sweep and m in (1, 16) and name != "8b.lm_head":
            timed = sweep(run, sweep_grid(), c)
            best_table[(name, m)] = timed[0]
            for rank, (us, b) in enumerate(timed[:3], 1):
                print(f"|  best {rank} | {m} | | | {us:.1f} | {pct(us):.1f}% | {b['BLOCK_N']}x{b['BLOCK_K']} split "
                      f"{b['SPLIT_K']} st {b['num_stages']} w {b['num_warps']} | |", flush=True)
    swiglu_table([n for n in names if n.endswith("gate_up")], rows, copy, ws)
    mid_rows = [int(r) for r in args.mid_rows.split(",") if r]
    mid_swiglu_table([n for n in names if n.endswith("gate_up")], mid_rows, copy, args.mid_sweep)
    if best_table:
        print("\nbest launches:", {f"{k[0]}@{k[1]}": (round(v[0], 1), v[1]) for k, v in best_table.items()})
    return 0


def swiglu_table(names: list[str], rows: list[int], copy: float, ws) -> None:
    """µs per gate/up projection + SwiGLU: fused epilogue vs GEMV then the ``silu_mul`` kernel."""
    from graphdsl.runtime.codegen.ops import silu_mul
    from graphdsl.runtime.kernels.gemv import gemv
    if not names:
        return
    print("\n| gate/up + SwiGLU | M | gemv + silu_mul µs | fused µs | fused % copy | same bits |")
    print("|---|---:|---:|---:|---:|---|")
    for name, n, k, weights, m, x in cases(names, rows):
        act, fused, t_two, t_one, _ = _time_swiglu(
            weights, x, n, lambda w, prod, act: silu_mul(gemv(x, w, out=prod, workspace=ws), out=act),
            lambda w, out, cfg: gemv(x, w, silu_mul=True, out=out, workspace=ws))
        same = torch.equal(act, fused)
        pct = 100 * (n * k + m * (k + n // 2)) * 2 / (t_one * 1e-6) / 1e9 / copy
        print(f"| {name} [{n}, {k}] | {m} | {t_two:.1f} | {t_one:.1f} | {pct:.1f}% | {same} |", flush=True)


def _time_swiglu(weights, x, n, two_kernels, fused):
    """Both paths of a gate/up projection + SwiGLU over the weight copies: ``two_kernels(w, prod,
    act)`` and ``fused(w, out, config)``. Returns ``(act, out, µs two, µs fused, run_fused)``, the
    outputs those of the last copy and ``run_fused(config)`` the fused path over all copies."""
    m = x.shape[0]
    prod = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(m, n // 2, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(act)

    def two():
        for w in weights:
            two_kernels(w, prod, act)

    def one(cfg=None):
        for w in weights:
            fused(w, out, cfg)
    two()
    one()
    return act, out, replay_us(two, len(weights)), replay_us(one, len(weights)), one


def mid_swiglu_grid():
    for bm, bn, bk, stages, warps in itertools.product((64, 128, 256), (64, 128), (64, 128), (3, 4), (4, 8)):
        if (bm + 2 * bn) * bk * 2 * stages <= 200 * 1024 and bm * bn <= 2048 * warps:
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps)


def mid_swiglu_table(names: list[str], rows: list[int], copy: float, mid_sweep: bool) -> None:
    """µs per gate/up projection + SwiGLU at 17-256 rows: cuBLAS then ``silu_mul`` vs the tiled GEMM."""
    from graphdsl.runtime.codegen.ops import silu_mul
    from graphdsl.runtime.kernels.swiglu_gemm import launch_for, swiglu_gemm
    if not names or not rows:
        return
    print("\n| gate/up + SwiGLU, mid rows | M | cuBLAS + silu_mul µs | swiglu_gemm µs | speedup | "
          "TFLOP/s | % copy | launch | max rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, n, k, weights, m, x in cases(names, rows):
        c = len(weights)
        act, fused, t_two, t_one, one = _time_swiglu(
            weights, x, n, lambda w, prod, act: silu_mul(torch.matmul(x, w.T, out=prod), out=act),
            lambda w, out, cfg: swiglu_gemm(x, w, out=out, config=cfg))
        err = ((fused.float() - act.float()).abs().max() / act.float().abs().max()).item()
        tflops = 2 * m * n * k / (t_one * 1e-6) / 1e12
        pct = 100 * (n * k + m * (k + n // 2)) * 2 / (t_one * 1e-6) / 1e9 / copy
        cfg = launch_for(m, k)      # None: the backend keeps cuBLAS + silu_mul at this M (timed: the fallback tile)
        launch = "cuBLAS kept" if cfg is None else \
            f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} st {cfg['STAGES']} w {cfg['num_warps']}"
        print(f"| {name} [{n}, {k}] | {m} | {t_two:.1f} | {t_one:.1f} | {t_two / t_one:.2f}x | {tflops:.0f} | "
              f"{pct:.1f}% | {launch} | {err:.1e} |", flush=True)
        if mid_sweep:
            timed = sweep(one, mid_swiglu_grid(), c)
            for rank, (us, b) in enumerate(timed[:3], 1):
                print(f"|  best {rank} | {m} | | {us:.1f} | {t_two / us:.2f}x | | | {b['BLOCK_M']}x{b['BLOCK_N']}x"
                      f"{b['BLOCK_K']} st {b['STAGES']} w {b['num_warps']} | |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
