"""Achieved memory bandwidth of the fused memory-bound kernels vs the measured copy bandwidth.

    python benchmarks/kernels.py [--tokens 1 16 128 1024 4096] [--out results.md]

Kernels (Llama-3-8B shapes, bf16): add+RMSNorm (hidden 4096), SwiGLU (intermediate 14336, packed
[gate | up] input), RoPE + KV-cache write (32 q heads, 8 kv heads, head dim 128). Bytes are the
fewest the op must move (each input read once, each output written once); the copy bandwidth is a
device-to-device copy of 1 GiB measured in the same run (bytes read + written). Times are medians
from ``triton.testing.do_bench`` (median of three runs); the ``graph`` column replays the launch in a CUDA graph (no host
launch overhead), which is what engines replaying CUDA graphs see. Target: >= 80% of copy at 4096
tokens. Also prints the unfused torch time of the same math for comparison.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # benchmarks/common.py, also when loaded by path
from common import bench_ms, copy_bandwidth_gbs  # noqa: E402

HIDDEN, INTER, HQ, HK, D, BLOCK = 4096, 14336, 32, 8, 128, 16


def bench(fn, repeats: int = 3) -> float:
    """Milliseconds: the median of three do_bench medians (see ``benchmarks/common.py``)."""
    return bench_ms(fn, repeats=repeats)


def bench_graph(fn) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    except Exception as e:  # noqa: BLE001 - report and go on: the events number stands alone
        print(f"  (cuda graph timing unavailable: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def _add_rms_norm_case(T):
    from graphdsl.runtime.codegen.fused import prepare_fused
    from graphdsl.runtime.codegen.ops import add_rms_norm_program
    x, r = (torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    out, res = torch.empty_like(x), torch.empty_like(x)
    k, data = prepare_fused(add_rms_norm_program(1e-5), (4, 3), [x, r, w], [out, res])
    ins = [[x, r, w][i] for i in data]
    nbytes = 4 * T * HIDDEN * 2 + HIDDEN * 2

    def torch_ref():
        s = x + r
        sf = s.float()
        return w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(s.dtype)
    return (lambda: k(ins, [out, res])), torch_ref, nbytes


def _silu_mul_case(T):
    from graphdsl.runtime.codegen.fused import prepare_fused
    from graphdsl.runtime.codegen.ops import SILU_MUL_PROGRAM
    x = torch.randn(T, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(T, INTER, device="cuda", dtype=torch.bfloat16)
    halves = [x[:, :INTER], x[:, INTER:]]
    k, data = prepare_fused(SILU_MUL_PROGRAM, (3,), halves, [out])
    ins = [halves[i] for i in data]
    nbytes = 3 * T * INTER * 2

    def torch_ref():
        g, u = x.chunk(2, -1)
        return torch.nn.functional.silu(g) * u
    return (lambda: k(ins, [out])), torch_ref, nbytes


def _rope_cache_case(T):
    from graphdsl.functional.attention import RopeLayout
    from graphdsl.runtime.codegen.rope_cache import prepare_rope_cache
    nblocks = 4096 // BLOCK + 8
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(T, D // 2, device="cuda"), torch.randn(T, D // 2, device="cuda")
    slots = torch.randperm(nblocks * BLOCK, device="cuda")[:T]
    kc = torch.zeros(nblocks, BLOCK, HK, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    q_out = torch.empty_like(q)
    nbytes = T * (2 * HQ * D * 2 + 4 * HK * D * 2 + 2 * (D // 2) * 4 + 8)

    def torch_ref():
        from graphdsl.opdef import get_op
        return get_op("rope_cache").reference(q, k, v, kc, vc, cos, sin, slots)
    kern = prepare_rope_cache(q, k, v, kc, vc, cos, sin, slots, q_out, RopeLayout.NEOX)
    return (lambda: kern(q, k, v, kc, vc, cos, sin, slots, q_out)), torch_ref, nbytes


CASES = {"add_rms_norm": _add_rms_norm_case, "silu_mul (SwiGLU)": _silu_mul_case, "rope_cache": _rope_cache_case}


def sweep_warps(T: int, copy: float) -> list[str]:
    """The launch heuristic's choice against other warp counts, at ``T`` tokens (events, median)."""
    import dataclasses

    from graphdsl.functional.attention import RopeLayout
    from graphdsl.runtime.codegen.fused import prepare_fused
    from graphdsl.runtime.codegen.ops import SILU_MUL_PROGRAM, add_rms_norm_program
    from graphdsl.runtime.codegen.rope_cache import prepare_rope_cache
    lines = [f"warp sweep at {T} tokens (GB/s, % of copy); * = the heuristic's choice"]
    x, r = (torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    out, res = torch.empty_like(x), torch.empty_like(x)
    k, _ = prepare_fused(add_rms_norm_program(1e-5), (4, 3), [x, r, w], [out, res])
    g = torch.randn(T, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    o2 = torch.empty(T, INTER, device="cuda", dtype=torch.bfloat16)
    k2, _ = prepare_fused(SILU_MUL_PROGRAM, (3,), [g[:, :INTER], g[:, INTER:]], [o2])
    for name, kern, ins, outs, nbytes in (("add_rms_norm", k, [x, r, w], [out, res], 4 * T * HIDDEN * 2),
                                         ("silu_mul", k2, [g[:, :INTER], g[:, INTER:]], [o2], 3 * T * INTER * 2)):
        cells = []
        for warps in (2, 4, 8, 16):
            kv = dataclasses.replace(kern, num_warps=warps)
            ms = bench(lambda: kv(ins, outs))
            bw = nbytes / (ms * 1e-3) / 1e9
            cells.append(f"{warps}w{'*' if warps == kern.num_warps else ''} {bw:.0f} ({100 * bw / copy:.0f}%)")
        lines.append(f"  {name:<14} " + "   ".join(cells))
    make = _rope_cache_case(T)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    kk, v = (torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos, sin = torch.randn(T, D // 2, device="cuda"), torch.randn(T, D // 2, device="cuda")
    nblocks = 4096 // BLOCK + 8
    slots = torch.randperm(nblocks * BLOCK, device="cuda")[:T]
    kc, vc = (torch.zeros(nblocks, BLOCK, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qo = torch.empty_like(q)
    nbytes = make[2]
    cells = []
    for warps in (2, 4, 8, 16):
        kern = prepare_rope_cache(q, kk, v, kc, vc, cos, sin, slots, qo, RopeLayout.NEOX, num_warps=warps)
        ms = bench(lambda: kern(q, kk, v, kc, vc, cos, sin, slots, qo))
        bw = nbytes / (ms * 1e-3) / 1e9
        cells.append(f"{warps}w{'*' if warps == 8 else ''} {bw:.0f} ({100 * bw / copy:.0f}%)")
    lines.append(f"  {'rope_cache':<14} " + "   ".join(cells))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    import graphdsl.passes  # noqa: F401 - registers the fused ops
    copy = copy_bandwidth_gbs()
    dev = torch.cuda.get_device_name()
    rows = []
    for name, make in CASES.items():
        for T in args.tokens:
            fn, ref, nbytes = make(T)
            ms = bench(fn)
            g = bench_graph(fn)
            ref_ms = bench(ref)
            bw = nbytes / (ms * 1e-3) / 1e9
            gbw = nbytes / (g * 1e-3) / 1e9 if g else float("nan")
            rows.append((name, T, nbytes / 1e6, ms * 1e3, bw, 100 * bw / copy, gbw, 100 * gbw / copy, ref_ms * 1e3))
            print(f"{name:<18} T={T:<5} {ms * 1e3:9.1f} us  {bw:7.0f} GB/s  ({100 * bw / copy:5.1f}% of copy)"
                  f"  graph {gbw:7.0f} GB/s  torch {ref_ms * 1e3:9.1f} us", flush=True)
    lines = [f"device: {dev}, torch {torch.__version__}, triton {triton.__version__}",
             f"copy bandwidth (1 GiB bf16 device-to-device, read + write): {copy:.0f} GB/s", "",
             "| kernel | tokens | MB moved | us (median) | GB/s | % of copy | GB/s (CUDA graph) | % of copy (graph) "
             "| unfused torch us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, T, mb, us, bw, pct, gbw, gpct, rus in rows:
        lines.append(f"| {name} | {T} | {mb:.2f} | {us:.1f} | {bw:.0f} | {pct:.1f}% | {gbw:.0f} | {gpct:.1f}% | {rus:.1f} |")
    try:
        lines += [""] + sweep_warps(max(args.tokens), copy)
    except Exception as e:  # noqa: BLE001 - the sweep is extra; keep the main table
        lines += ["", f"warp sweep failed: {type(e).__name__}: {e}"]
    table = "\n".join(lines)
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
