"""Benchmark of the Triton paged-attention kernels (runtime/kernels/paged_attention.py).

Prints, for a Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16,
block size 16):

* decode at batch 1/8/64 x context 512/4096: time of the Python call and of a CUDA-graph replay
  of it (how the engine runs decode), GB/s of KV-cache bytes read per graph replay, and % of the
  device-to-device copy bandwidth measured in the same run (bytes read + bytes written);
* prefill (2048 new tokens as 1x2048 and 4x512, and 2048 new tokens after a 2048-token cached
  prefix): time, TFLOP/s of the causal attention (4 * heads * head_dim per visible query-key pair)
  and % of a bf16 ``torch.matmul`` 8192^3 rate measured in the same run.

Times are ``triton.testing.do_bench`` medians (it flushes L2 between repetitions). ``--sweep``
also times a few tile configurations of each kernel (checked against the default one) to tune
``_pick_config``. Usage: ``python benchmarks/attention.py [--sweep]`` on a CUDA machine.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from typing import NamedTuple

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # benchmarks/common.py, also when loaded by path
from common import bench_ms, copy_bandwidth_gbs, matmul_tflops  # noqa: E402

# the module (the package's ``paged_attention`` attribute is the function of the same name)
pa = importlib.import_module("graphdsl.runtime.kernels.paged_attention")

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _median_ms(fn) -> float:
    return bench_ms(fn, repeats=1, rep_ms=100)


def _graph_ms(fn) -> float:
    """Median time of a CUDA-graph replay of ``fn``: how the engine runs decode (no launch gaps,
    no Python argument checks), so small decode batches show the kernels' own time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                   # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _median_ms(graph.replay)


def make_paged(lens, news, *, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
               dtype=DTYPE, seed=0):
    """Random q and caches; each sequence's blocks are scattered (a random permutation)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = [math.ceil(L / block_size) for L in lens]
    num_blocks = sum(per_seq)
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    order = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = order[used:used + nb]
        used += nb
    qsl = torch.tensor([0] + list(torch.tensor(news).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    q = torch.randn(int(sum(news)), heads, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), qsl


class DecodeResult(NamedTuple):
    eager_ms: float     # do_bench median of the Python call (argument checks + launches + kernels)
    graph_ms: float     # do_bench median of a CUDA-graph replay of the same call
    gbs: float          # KV-cache bytes read / graph_ms
    splits: int
    out: torch.Tensor


def bench_decode(batch: int, ctx: int, *, num_splits=None, config=None) -> DecodeResult:
    """Decode at ``batch`` sequences of ``ctx`` keys each."""
    q, kc, vc, bt, sl, _ = make_paged([ctx] * batch, [1] * batch)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    splits = num_splits or pa._default_splits(batch, KV_HEADS, bt.shape[1] * BLOCK_SIZE, q.device)
    ws = pa.decode_workspace(batch, HEADS, KV_HEADS, HEAD_DIM, splits, q.device)   # kept, as the engine does
    run = lambda: pa._launch_decode(q, kc, vc, bt, sl, scale, 0, 0.0, out, splits, config, ws)  # noqa: E731
    eager = _median_ms(run)
    graph = _graph_ms(run)
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * kc.element_size()
    return DecodeResult(eager, graph, kv_bytes / graph / 1e6, splits, out)


def bench_prefill(num_seqs: int, new: int, prefix: int = 0, *, config=None):
    """(ms, TFLOP/s) of prefill: ``num_seqs`` sequences of ``new`` tokens after ``prefix`` cached."""
    L = prefix + new
    q, kc, vc, bt, sl, qsl = make_paged([L] * num_seqs, [new] * num_seqs)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    run = lambda: pa._launch_prefill(q, kc, vc, bt, sl, qsl, scale, 0, 0.0, out, config)  # noqa: E731
    ms = _median_ms(run)
    pairs = num_seqs * sum(prefix + i + 1 for i in range(new))
    flops = 4 * HEADS * HEAD_DIM * pairs
    return ms, flops / ms / 1e9, out


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep() -> list[str]:
    """Time alternative tile configs (block_m, block_n, warps, stages) against the heuristic's."""
    lines = []
    C = pa._Config
    decode_cfgs = [C(16, 64, 4, 3), C(16, 64, 4, 4), C(16, 128, 4, 2), C(16, 32, 4, 3), C(16, 32, 4, 4),
                   C(16, 64, 8, 3), C(16, 64, 2, 2), C(16, 32, 2, 2)]
    for batch, ctx in ((1, 512), (1, 4096), (8, 4096), (64, 512), (64, 4096), (256, 512)):
        base = bench_decode(batch, ctx)
        lines.append(f"decode b={batch} ctx={ctx} default {pa._pick_config(HEAD_DIM, 4, decode=True)} "
                     f"splits={base.splits}: graph {base.graph_ms * 1e3:.1f} us {base.gbs:.0f} GB/s")
        for cfg in decode_cfgs:
            try:
                r = bench_decode(batch, ctx, config=cfg)
                lines.append(f"  {cfg}: graph {r.graph_ms * 1e3:.1f} us {r.gbs:.0f} GB/s "
                             f"err={_rel(r.out, base.out):.1e}")
            except Exception as e:  # a config the compiler rejects (shared memory) is a result too
                lines.append(f"  {cfg}: failed {type(e).__name__}: {str(e)[:80]}")
        if batch == 1 or ctx == 512:
            for splits in (1, 2, 4, 8, 16, 32, 64)[:7 if batch == 1 else 4]:
                r = bench_decode(batch, ctx, num_splits=splits)
                lines.append(f"  splits={splits}: graph {r.graph_ms * 1e3:.1f} us {r.gbs:.0f} GB/s")
    prefill_cfgs = [C(64, 64, 4, 2), C(128, 64, 8, 3), C(128, 128, 8, 3), C(64, 32, 4, 3),
                    C(64, 64, 8, 3)]
    base = bench_prefill(1, 2048)
    lines.append(f"prefill 1x2048 default {pa._pick_config(HEAD_DIM, 4, decode=False)}: "
                 f"{base[0] * 1e3:.1f} us {base[1]:.0f} TFLOP/s")
    for cfg in prefill_cfgs:
        try:
            r = bench_prefill(1, 2048, config=cfg)
            lines.append(f"  {cfg}: {r[0] * 1e3:.1f} us {r[1]:.0f} TFLOP/s err={_rel(r[2], base[2]):.1e}")
        except Exception as e:
            lines.append(f"  {cfg}: failed {type(e).__name__}: {str(e)[:80]}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    dev = torch.cuda.get_device_name()
    copy = copy_bandwidth_gbs()
    mm = matmul_tflops()
    if args.sweep:
        print("\n".join(sweep()))
    rows = []
    for batch in (1, 8, 64):
        for ctx in (512, 4096):
            r = bench_decode(batch, ctx)
            name = f"decode b={batch} ctx={ctx}"
            rows.append(f"| {name:<27} | {r.splits:>6} | {r.eager_ms * 1e3:9.1f} | {r.graph_ms * 1e3:9.1f} "
                        f"| {r.gbs:7.0f} GB/s | {100 * r.gbs / copy:5.1f}% of copy |")
    for num_seqs, new, prefix in ((1, 2048, 0), (4, 512, 0), (1, 2048, 2048)):
        ms, tflops, _ = bench_prefill(num_seqs, new, prefix)
        name = f"prefill {num_seqs}x{new}" + (f" +{prefix} prefix" if prefix else "")
        rows.append(f"| {name:<27} | {'':>6} | {ms * 1e3:9.1f} | {'':>9} | {tflops:7.0f} TF/s "
                    f"| {100 * tflops / mm:5.1f}% of mm   |")
    print(f"\n{dev}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16, block_size {BLOCK_SIZE}")
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write); bf16 matmul 8192^3: {mm:.0f} TFLOP/s")
    print("rate: decode = KV bytes read / graph time; prefill = causal attention FLOPs / eager time")
    print("| case                        | splits | eager us  | graph us  | rate         | vs ceiling        |")
    print("|-----------------------------|--------|-----------|-----------|--------------|-------------------|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
