"""GGUF dequantize-in-GEMV (runtime/kernels/gguf_linear.py) on the Llama-3-8B projection shapes.

    python benchmarks/gguf_gemv.py [--rows 1] [--types Q4_K,Q6_K] [--shapes 8b.o] [--sweep] [--prefill]
                                   [--config '{"USE_DOT": true, "BLOCK_N": 32}']
    python benchmarks/gguf_gemv.py --many --rows 2,8,16,17,32,64,128 [--sweep]

For each GGML block type and weight shape ``[N, K]`` (8B: o 4096x4096, qkv 6144x4096, gate/up
14336x4096, down 4096x14336): checks ``gguf_gemv`` against the torch reference (dequantize, then a
float32 matmul), then prints µs per call, the block bytes per call (weight blocks + activations +
output), the GB/s they make and the % of the device-to-device copy bandwidth measured in the same
run; and the bf16 cuBLAS GEMV of the same shape (its own bytes) for comparison. The table's launch
is the CUDA-core one (``_pick_config``); for one row of a type the tensor cores take
(``gguf_mma.MMA_QTYPES``: Q4_K; and Q6_K, ``gguf_mma_q6k``; Q5_K and Q8_0 on the rows kernel, ``gguf_mma_rows``,
``gguf_linear._ONE_ROW_ON_ROWS``) the last
columns time that path (activation planes launch included, ``pick_mma_config`` / ``pick_rows_config``) and its
speedup over the CUDA-core launch.

Timing is how decode runs them: one CUDA graph replays the GEMV over enough copies of the weight
to overflow L2 (every launch reads its blocks from HBM), time per launch = replay time / copies.
``--sweep`` also times a grid of launch configs per type and shape and prints the best (to tune
``_pick_config``); for the one-row tensor-core path it sweeps that GEMV's launches too (row tiles,
warps, pipeline stages, K slices; the A operand made beforehand, as the model's producers make it:
to tune ``pick_mma_config`` / ``pick_q6k_config``). ``--prefill`` adds a table of ``gguf_linear`` at 512 rows (dequantize + cuBLAS)
against the bf16 matmul. ``--busiest-sm`` prints only one table: the one-row tensor-core GEMVs
(Q4_K, Q6_K; one K slice, the A operand given) over ``N = tiles x 64`` rows for tile counts just
under, at and just over multiples of the SM count, with the time per SM's worth of tiles: a
one-row GEMV runs as long as its busiest SM, so a few tiles past a multiple cost a whole program
more on those SMs (docs/quantization-log.md). ``--many`` prints only the table of several rows
(:func:`many_rows`: batched decode and short prefills, the plane-a-dot GEMV against the decoded
tile and dequantize + cuBLAS).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line  # noqa: E402

SHAPES = {"8b.o": (4096, 4096), "8b.qkv": (6144, 4096), "8b.gate": (14336, 4096), "8b.down": (4096, 14336)}
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# float16 scale fields (byte range in a block) set to small values in the random blocks
_F16_FIELDS = {"Q4_0": (0, 2), "Q4_1": (0, 4), "Q5_0": (0, 2), "Q5_1": (0, 4), "Q8_0": (0, 2), "Q4_K": (0, 4),
               "Q5_K": (0, 4), "Q6_K": (208, 210)}


def random_blocks(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random GGML rows on the GPU with small float16 scales, in the layout a CUDA bind stores
    (``gguf_blocks.to_stored``: Q6_K padded to 224-byte blocks; block-major unless
    ``layers.quantize.GGUF_BLOCKS`` is off)."""
    from graphdsl.layers import quantize
    from graphdsl.runtime.gguf_blocks import GGUF_BLOCKS, block_major, to_stored
    per, size = GGUF_BLOCKS[qtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    data = torch.randint(0, 256, (n, k // per, size), generator=g, device="cuda", dtype=torch.uint8)
    lo, hi = _F16_FIELDS[qtype]
    scales = (torch.rand(n, k // per, (hi - lo) // 2, generator=g, device="cuda") - 0.5) * 0.02
    data[:, :, lo:hi] = scales.to(torch.float16).view(torch.uint8)
    stored = to_stored(data.reshape(n, -1), qtype)
    return block_major(stored, qtype) if quantize.GGUF_BLOCKS else stored


def replay_us(fn, copies: int) -> float:
    """µs per launch: ``fn`` (``copies`` launches) captured in one CUDA graph, median replay time."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3 / copies


def copies_for(nbytes: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return max(2, -(-4 * l2 // nbytes))


def check(x, data, qtype):
    from graphdsl.runtime.gguf_blocks import dequantize_blocks, from_stored, row_major
    from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
    k = x.shape[1]
    rows = row_major(data, qtype) if data.dim() == 3 else data
    want = x.float() @ dequantize_blocks(from_stored(rows, qtype), qtype, k).T
    got = gguf_gemv(x, data, qtype).float()
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    if err > 2e-2:
        raise SystemExit(f"{qtype} {list(data.shape)}: relative error {err:.3g} vs the torch reference")


def sweep_configs(qtype: str, k: int):
    from graphdsl.runtime.kernels.gguf_linear import KERNEL_QTYPES, _sb_for
    values = KERNEL_QTYPES[qtype][0]
    sbs = sorted({_sb_for(k // values, s * 256 // values) for s in (1, 2)})
    for sb, bn, warps, split, ahead in itertools.product(sbs, (8, 16, 32), (2, 4), (1, 2, 4, 8), (False, True)):
        yield dict(SB=sb, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=1, PREFETCH=ahead)


def sweep_mma_configs():
    """The tensor-core GEMV launches ``--sweep`` times: 32/64/128-row tiles, 4/8 warps, 2-4 pipeline
    stages, 1-8 K slices (``gguf_gemv``'s ``config={"MMA": True, ...}``)."""
    for bn, warps, stages, split in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8)):
        yield dict(MMA=True, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages)


def sweep_mma(x, datas, qtype: str, nbytes: int, copy: float) -> None:
    """Time :func:`sweep_mma_configs` on one row of ``qtype`` (A operand given) and print the best three."""
    from graphdsl.quant import code_rows
    from graphdsl.runtime.kernels.gemv import GemvWorkspace
    from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
    from graphdsl.runtime.kernels.gguf_mma import activation_planes
    from graphdsl.runtime.kernels.gguf_mma_q6k import q6k_activation_planes
    planes = q6k_activation_planes(x[0]) if qtype == "Q6_K" else activation_planes(x[0])
    ws = GemvWorkspace()
    out = torch.empty(1, code_rows(datas[0]), dtype=x.dtype, device=x.device)
    results = []
    for c in sweep_mma_configs():
        try:
            t = replay_us(lambda: [gguf_gemv(x, d, qtype, out=out, workspace=ws, config=c, planes=planes)
                                   for d in datas], len(datas))
        except Exception as e:  # a launch the compiler rejects (registers, shared memory)
            print(f"    {c}: {type(e).__name__}", flush=True)
            continue
        results.append((t, c))
    for t, c in sorted(results, key=lambda r: r[0])[:3]:
        print(f"    tensor-core sweep {qtype}: {t:7.1f} µs {100 * nbytes / (t * 1e-6) / 1e9 / copy:5.0f}%  {c}",
              flush=True)


def busiest_sm_tiles(sms: int) -> list[int]:
    """Tile counts for ``--busiest-sm``: one to four programs a SM, a few tiles either side of three,
    and the Llama-3-8B gate/up's 448 (28672 rows)."""
    return sorted({sms, sms + sms // 2, 2 * sms, 3 * sms - 10, 3 * sms, 3 * sms + 10, 448, 4 * sms - 10, 4 * sms})


def busiest_sm() -> None:
    """``--busiest-sm``: one-row Q4_K and Q6_K tensor-core GEMVs of ``tiles x 64`` rows, K 4096, one
    slice, A operand given; µs a launch and µs per SM's worth of tiles (module docstring)."""
    from graphdsl.runtime.kernels.gemv import GemvWorkspace
    from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
    from graphdsl.runtime.kernels.gguf_mma import activation_planes
    from graphdsl.runtime.kernels.gguf_mma_q6k import q6k_activation_planes
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k = 4096
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    print(f"\n| type | tiles of 64 rows | programs a SM | µs | µs per {sms} tiles |\n|---|---:|---:|---:|---:|")
    for qtype in ("Q4_K", "Q6_K"):
        planes = q6k_activation_planes(x[0]) if qtype == "Q6_K" else activation_planes(x[0])
        cfg = dict(MMA=True, BLOCK_N=64, SPLIT_K=1, num_warps=4, num_stages=2 if qtype == "Q6_K" else 3)
        for tiles in busiest_sm_tiles(sms):
            n = tiles * 64
            one = random_blocks(qtype, n, k, seed=0)
            datas = [one] + [random_blocks(qtype, n, k, seed=i) for i in range(1, copies_for(one.numel()))]
            out = torch.empty(1, n, dtype=x.dtype, device="cuda")
            ws = GemvWorkspace()
            us = replay_us(lambda: [gguf_gemv(x, d, qtype, out=out, workspace=ws, config=cfg, planes=planes)
                                    for d in datas], len(datas))
            print(f"| {qtype} | {tiles} | {tiles / sms:.2f} | {us:.2f} | {us / tiles * sms:.2f} |", flush=True)
            del datas, one
            torch.cuda.empty_cache()


def sweep_plane_configs(qtype: str, k: int):
    """The plane-a-dot launches ``--many --sweep`` times: 32/64/128-row tiles, 4/8 warps, 2-3 stages,
    1-4 K slices, a step of 256 values."""
    from graphdsl.runtime.kernels.gguf_linear import KERNEL_QTYPES
    for bn, warps, stages, split in itertools.product((32, 64, 128), (4, 8), (2, 3), (1, 2, 4)):
        yield dict(SB=256 // KERNEL_QTYPES[qtype][0], BLOCK_N=bn, SPLIT_K=split, num_warps=warps,
                   num_stages=stages, PLANES=True)


def sweep_rows_configs():
    """The several-row tensor-core launches ``--many --sweep`` times: 32- and 64-row tiles of 2 or 4
    warps, 2 stages, 1-16 K slices (the sweeps behind ``gguf_mma_rows.pick_rows_config``)."""
    for bn, warps, split in itertools.product((32, 64), (2, 4), (1, 2, 4, 8, 16)):
        yield dict(MMA=True, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=2)


def many_rows(rows: list[int], types: list[str], shapes: list[str], sweep: bool, copy: float) -> None:
    """``--many``: GGUF linears of several rows (batched decode, short prefills), µs a call: the default
    (``gguf_linear``: the GEMV up to ``gemv_rows``, else dequantize + cuBLAS), the plane-a-dot GEMV
    (forced up to ``gemv_rows``; for Q4_K / Q6_K also with the float32 plane decode instead of the
    packed-PTX one, ``_FAST_PLANES`` off), the decoded-tile GEMV (up to 16 rows), dequantize +
    cuBLAS, and the bf16 matmul of the same shape; weights from HBM (CUDA-graph replay over copies,
    :func:`replay_us`). With ``--sweep``, the best three plane launches per row."""
    import graphdsl.runtime.kernels.gguf_linear as gl
    from graphdsl.runtime.gguf_blocks import row_bytes
    from graphdsl.runtime.kernels.gemv import GemvWorkspace
    from graphdsl.runtime.kernels.gguf_linear import (_ONE_ROW_ON_ROWS, MAX_GEMV_ROWS, PLANE_QTYPES, _num_sms,
                                                      _pick_config, gemv_rows,
                                                      gguf_dequantize, gguf_gemv, gguf_linear)
    from graphdsl.runtime.kernels.gguf_mma_rows import MMA_ROWS, pick_rows_config
    print(f"\n| type | shape | rows | default µs | % copy | tensor-core rows µs | planes µs | float32 planes µs "
          f"| tile µs | dequantize + cuBLAS µs | bf16 µs |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in shapes:
        n, k = SHAPES[name]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for qtype in types:
            one = random_blocks(qtype, n, k, seed=0)
            datas = [one] + [random_blocks(qtype, n, k, seed=i) for i in range(1, copies_for(one.numel()))]
            ws = GemvWorkspace()
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                if m <= gemv_rows(qtype):
                    check(x, one, qtype)

                def timed(f):
                    return replay_us(lambda: [f(d) for d in datas], len(datas))

                default = timed(lambda d: gguf_linear(x, d, qtype))
                nbytes = n * row_bytes(qtype, k) + m * k * 2 + m * n * 2
                planes = f32 = tile = mrows = "-"
                low = 1 if qtype in _ONE_ROW_ON_ROWS else 2      # one row of Q5_K / Q8_0 runs the rows kernel too
                rows_ok = qtype in ("Q4_K", "Q5_K", "Q6_K", "Q8_0") and low <= m <= MMA_ROWS
                if rows_ok:            # the several-row tensor-core kernel (gguf_mma_rows)
                    cfg = {"MMA": True, **pick_rows_config(n, k, _num_sms(x.device), m, qtype)}
                    mrows = f"{timed(lambda d: gguf_gemv(x, d, qtype, out=out, workspace=ws, config=cfg)):.1f}"
                planes_ok = qtype in PLANE_QTYPES and 1 < m <= gemv_rows(qtype)    # (beyond: refused)
                if planes_ok:
                    cfg = {**_pick_config(m, n, k, qtype, x.device), "PLANES": True}
                    planes = f"{timed(lambda d: gguf_gemv(x, d, qtype, out=out, workspace=ws, config=cfg)):.1f}"
                    if qtype in ("Q4_K", "Q6_K"):      # the planes' float32 decode (A/B of the packed PTX)
                        gl._FAST_PLANES = False
                        try:
                            f32 = f"{timed(lambda d: gguf_gemv(x, d, qtype, out=out, workspace=ws, config=cfg)):.1f}"
                        finally:
                            gl._FAST_PLANES = True
                if 1 < m <= MAX_GEMV_ROWS:
                    cfg = {**_pick_config(m, n, k, qtype, x.device), "PLANES": False, "BLOCK_N": 32,
                           "num_stages": 1}
                    tile = f"{timed(lambda d: gguf_gemv(x, d, qtype, out=out, workspace=ws, config=cfg)):.1f}"
                deq = timed(lambda d: torch.nn.functional.linear(x, gguf_dequantize(d, qtype, x.dtype)))
                bf16 = replay_us(lambda: [x @ w.T for w in wb], len(wb))
                print(f"| {qtype} | {name} | {m} | {default:.1f} | {100 * nbytes / (default * 1e-6) / 1e9 / copy:.0f}% | "
                      f"{mrows} | {planes} | {f32} | {tile} | {deq:.1f} | {bf16:.1f} |", flush=True)
                if sweep and (planes_ok or rows_ok):
                    results = []
                    for c in (sweep_rows_configs() if rows_ok else sweep_plane_configs(qtype, k)):
                        try:
                            results.append((timed(lambda d: gguf_gemv(x, d, qtype, out=out, workspace=ws,
                                                                      config=c)), c))
                        except Exception as e:  # a launch the compiler rejects (registers, shared memory)
                            print(f"    {c}: {type(e).__name__}", flush=True)
                    for t, c in sorted(results, key=lambda r: r[0])[:3]:
                        print(f"    {'rows' if rows_ok else 'plane'} sweep {qtype} {name} {m} rows: {t:7.1f} µs  {c}",
                              flush=True)
            del datas, one
            torch.cuda.empty_cache()
        del wb
        torch.cuda.empty_cache()


def main() -> None:
    from graphdsl.runtime.kernels.gguf_linear import _ONE_ROW_ON_ROWS, _num_sms, _pick_config, gguf_gemv, gguf_linear
    from graphdsl.runtime.gguf_blocks import row_bytes
    from graphdsl.runtime.kernels.gguf_mma import MMA_QTYPES, pick_mma_config
    from graphdsl.runtime.kernels.gguf_mma_q6k import pick_q6k_config
    from graphdsl.runtime.kernels.gguf_mma_rows import pick_rows_config
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1", help="activation rows, comma-separated (<= 16; any with --many)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--config", default=None, help='JSON merged into every launch, e.g. \'{"USE_DOT": true, "BLOCK_N": 32}\'')
    ap.add_argument("--many", action="store_true",
                    help="only the table of several rows (--rows, up to 64 and beyond): the plane GEMV, the decoded "
                         "tile, dequantize + cuBLAS and bf16 (many_rows)")
    ap.add_argument("--busiest-sm", action="store_true",
                    help="only the table of tensor-core GEMV times against the programs a SM (module docstring)")
    args = ap.parse_args()
    if args.busiest_sm:
        print(device_line())
        busiest_sm()
        return
    override = json.loads(args.config) if args.config else {}
    rows = [int(r) for r in args.rows.split(",")]
    types = args.types.split(",")
    shapes = args.shapes.split(",")
    if args.many:
        print(device_line())
        copy = copy_bandwidth_gbs()
        print(f"copy bandwidth: {copy:.0f} GB/s (device-to-device, read + write)")
        many_rows(rows, types, shapes, args.sweep, copy)
        return

    print(device_line())
    copy = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy:.0f} GB/s (device-to-device, read + write)\n")
    print(f"{'type':6} {'shape':8} {'N x K':>12} {'M':>3} {'MB':>7} {'µs':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'bf16 µs':>8} {'bf16 %':>6} {'speedup':>7} {'tc µs':>7} {'tc %':>5} {'tc/cc':>6}  config")
    best_rows = []
    for name in shapes:
        n, k = SHAPES[name]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us_bf16 = replay_us(lambda: [x @ w.T for w in wb], len(wb))
            bytes_bf16 = n * k * 2 + m * k * 2 + m * n * 2
            for qtype in types:
                one = random_blocks(qtype, n, k, seed=0)
                datas = [one] + [random_blocks(qtype, n, k, seed=i) for i in range(1, copies_for(one.numel()))]
                check(x, one, qtype)
                cfg = {**_pick_config(m, n, k, qtype, x.device), **override}
                us = replay_us(lambda: [gguf_gemv(x, d, qtype, config=cfg) for d in datas], len(datas))
                nbytes = n * row_bytes(qtype, k) + m * k * 2 + m * n * 2      # the file's block bytes
                gbs = nbytes / (us * 1e-6) / 1e9
                tc = f"{'-':>7} {'-':>5} {'-':>6}"
                if m == 1 and (qtype in MMA_QTYPES or qtype == "Q6_K" or qtype in _ONE_ROW_ON_ROWS):   # tensor cores
                    pick = pick_rows_config if qtype in _ONE_ROW_ON_ROWS else \
                        {"Q6_K": pick_q6k_config}.get(qtype, pick_mma_config)
                    tcfg = dict(MMA=True, **pick(n, k, _num_sms(x.device)))
                    us_tc = replay_us(lambda: [gguf_gemv(x, d, qtype, config=tcfg) for d in datas], len(datas))
                    tc = f"{us_tc:7.1f} {100 * nbytes / (us_tc * 1e-6) / 1e9 / copy:4.0f}% {us / us_tc:5.2f}x"
                print(f"{qtype:6} {name:8} {n:>5} x {k:<5} {m:>3} {nbytes / 1e6:7.1f} {us:8.1f} {gbs:7.0f} "
                      f"{100 * gbs / copy:5.0f}% {us_bf16:8.1f} {100 * bytes_bf16 / (us_bf16 * 1e-6) / 1e9 / copy:5.0f}% "
                      f"{us_bf16 / us:6.2f}x {tc}  {cfg}", flush=True)
                if args.sweep and m == 1:
                    results = []
                    for c in sweep_configs(qtype, k):
                        try:
                            t = replay_us(lambda: [gguf_gemv(x, d, qtype, config=c) for d in datas], len(datas))
                        except Exception as e:  # a config the compiler rejects (registers, shared memory)
                            print(f"    {c}: {type(e).__name__}", flush=True)
                            continue
                        results.append((t, c))
                    results.sort(key=lambda r: r[0])
                    for t, c in results[:3]:
                        print(f"    sweep {qtype} {name}: {t:7.1f} µs {100 * nbytes / (t * 1e-6) / 1e9 / copy:5.0f}%  {c}",
                              flush=True)
                    best_rows.append((qtype, name, results[0]))
                    if qtype in MMA_QTYPES or qtype == "Q6_K":
                        sweep_mma(x, datas, qtype, nbytes, copy)
                del datas, one
                torch.cuda.empty_cache()
        del wb
        torch.cuda.empty_cache()
    if best_rows:
        print("\nbest per (type, shape):")
        for qtype, name, (t, c) in best_rows:
            print(f"  {qtype:6} {name:8} {t:7.1f} µs  {c}")
    if args.prefill:
        print(f"\nprefill, 512 rows: gguf_linear (dequantize + cuBLAS) vs bf16 matmul")
        print(f"{'type':6} {'shape':8} {'µs':>8} {'bf16 µs':>8} {'TFLOP/s':>8}")
        for name in shapes:
            n, k = SHAPES[name]
            x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            ms_bf16 = bench_ms(lambda: x @ w.T)
            for qtype in types:
                d = random_blocks(qtype, n, k, seed=0)
                ms = bench_ms(lambda: gguf_linear(x, d, qtype))
                print(f"{qtype:6} {name:8} {ms * 1e3:8.1f} {ms_bf16 * 1e3:8.1f} {2 * 512 * n * k / (ms * 1e-3) / 1e12:8.1f}")


if __name__ == "__main__":
    main()
