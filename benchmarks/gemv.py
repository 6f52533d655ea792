"""Small-M GEMV (runtime/kernels/gemv.py) against cuBLAS on the decode projections of real shapes.

    python benchmarks/gemv.py [--sweep]

For each projection weight [N, K] of Llama-3-8B and Llama-3.2-1B and M = 1 and 8 rows: checks the
kernel against ``torch.matmul`` and prints µs and GB/s (weight + x + out bytes / time) of cuBLAS
and of the kernel with its heuristic tile, against the copy bandwidth measured in the same run.
``--sweep`` also times a grid of tiles at M = 1 and prints the best, to tune ``_pick_config``.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "8b.lm_head": (128256, 4096), "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048),
          "1b.down": (2048, 8192)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args(argv)
    from graphdsl.runtime.kernels.gemv import _pick_config, gemv
    copy = copy_bandwidth_gbs()
    print(f"## gemv vs cuBLAS — {device_line()}; copy {copy:.0f} GB/s\n")
    print("| weight | M | cuBLAS µs | cuBLAS % copy | gemv µs | gemv % copy | max rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = torch.empty_like(out)
            gemv(x, w, out=out)
            want = x.float() @ w.float().T
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            nbytes = (n * k + m * (n + k)) * 2
            t_blas = bench_ms(lambda: torch.matmul(x, w.T, out=ref), repeats=1)
            t_gemv = bench_ms(lambda: gemv(x, w, out=out), repeats=1)
            pct = lambda ms: 100 * nbytes / (ms * 1e-3) / 1e9 / copy  # noqa: E731
            print(f"| {name} [{n}, {k}] | {m} | {t_blas * 1e3:.1f} | {pct(t_blas):.1f}% | {t_gemv * 1e3:.1f} | "
                  f"{pct(t_gemv):.1f}% | {err:.1e} |")
            if args.sweep and m == 1:
                best = None
                for bn, bk, warps, stages in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8), (3, 5)):
                    if bn * bk > 16384:
                        continue
                    cfg = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                    ms = bench_ms(lambda: gemv(x, w, out=out, config=cfg), repeats=1, rep_ms=50)
                    if best is None or ms < best[0]:
                        best = (ms, cfg)
                print(f"|  best tile {best[1]} (heuristic {_pick_config(1, n, k, x.device)}) | 1 | | | "
                      f"{best[0] * 1e3:.1f} | {pct(best[0]):.1f}% | |")
        del w
    return 0


if __name__ == "__main__":
    sys.exit(main())
