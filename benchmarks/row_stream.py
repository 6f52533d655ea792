"""How fast can a decode GEMV's weight stream go, by the shape of what one program reads a step?

    python benchmarks/row_stream.py [--row-bytes 2048] [--mb 256]

A batch-1 GEMV only reads its weight once, so its ceiling is the rate at which its access pattern
streams from HBM. The one-row loops read a ``[BLOCK_N rows, W words]`` piece of a row-major matrix
each step (``W`` int32 words of one row contiguous, rows ``row_bytes`` apart), the next step's
piece loaded before this one is used, the K dimension split over ``split`` programs. This times
that pattern with nothing but an integer sum on the data, for several ``W`` (bytes contiguous per
row a step), ``BLOCK_N`` and splits, over ``--mb`` MB of rows ``--row-bytes`` long (2048 = an int4
row of K = 4096; 7168 = int4 K = 14336), and the same programs reading a *tile-major* copy (each
step's ``BLOCK_N x W`` piece contiguous, as a repacked weight would be), against the device copy
bandwidth. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line  # noqa: E402


@triton.jit
def _stream(q_ptr, out_ptr, W_ROW, K_SPLIT_W, BLOCK_N: tl.constexpr, W: tl.constexpr, TILED: tl.constexpr):
    """Sum the int32 words of rows ``[pid_n * BLOCK_N, +BLOCK_N)``, words ``[pid_k * K_SPLIT_W, +K_SPLIT_W)``,
    ``W`` words a step with a one-step prefetch; ``TILED``: the same words stored tile-major (each
    program's step piece contiguous, pieces in (row tile, word step) order)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, W)
    lo = pid_k * K_SPLIT_W
    if TILED:
        base = q_ptr + pid_n.to(tl.int64) * BLOCK_N * W_ROW + lo * BLOCK_N
        piece = tl.arange(0, BLOCK_N)[:, None] * W + rc[None, :]
        nxt = tl.load(base + piece)
        acc = tl.zeros([BLOCK_N, W], tl.int32)
        for c in range(0, K_SPLIT_W, W):
            cur = nxt
            nxt = tl.load(base + tl.minimum(c + W, K_SPLIT_W - W) * BLOCK_N + piece)
            acc += cur
    else:
        rows = q_ptr + rn.to(tl.int64)[:, None] * W_ROW + lo + rc[None, :]
        nxt = tl.load(rows)
        acc = tl.zeros([BLOCK_N, W], tl.int32)
        for c in range(0, K_SPLIT_W, W):
            cur = nxt
            nxt = tl.load(rows + tl.minimum(c + W, K_SPLIT_W - W))
            acc += cur
    tl.store(out_ptr + pid_k * tl.num_programs(0) * BLOCK_N + rn, tl.sum(acc, axis=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[2048, 7168])
    ap.add_argument("--mb", type=int, default=256)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("row_stream.py needs a CUDA GPU", file=sys.stderr)
        return 2
    copy = copy_bandwidth_gbs()
    print(f"device: {device_line()}; copy bandwidth {copy:.0f} GB/s\n")
    print("| row bytes | layout | BLOCK_N | bytes a row a step | split | warps | GB/s | % of copy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row_bytes in args.row_bytes:
        w_row = row_bytes // 4
        rows = (args.mb << 20) // row_bytes
        q = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, w_row), dtype=torch.int32, device="cuda")
        for block_n, w, split, warps, tiled in itertools.product((64, 128, 256), (16, 32, 64, 128), (1, 2, 4, 8),
                                                                 (4, 8), (False, True)):
            k_split = w_row // split
            if k_split < 2 * w or k_split % w or rows % block_n or block_n * w > 256 * 128:
                continue
            out = torch.empty(split * rows, dtype=torch.int32, device="cuda")
            grid = (rows // block_n, split)
            if tiled:   # the tile-major order of the same element count; contents do not matter here
                src = q.view(-1)
            else:
                src = q
            ms = bench_ms(lambda: _stream[grid](src, out, w_row, k_split, BLOCK_N=block_n, W=w, TILED=tiled,
                                                num_warps=warps), repeats=1, rep_ms=60)
            gbs = q.numel() * 4 / (ms * 1e-3) / 1e9
            print(f"| {row_bytes} | {'tile-major' if tiled else 'row-major'} | {block_n} | {4 * w} | {split} | "
                  f"{warps} | {gbs:.0f} | {100 * gbs / copy:.0f}% |", flush=True)
        del q
    return 0


if __name__ == "__main__":
    sys.exit(main())
