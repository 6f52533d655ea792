"""Where a decode step's time goes: per-kernel times and the GEMM bandwidth of every projection.

    python benchmarks/profile_decode.py --shape llama-3-8b [--batch 1] [--context 512]

Prints, on one device:

1. the graph-replayed decode step time (what ``LLM`` runs) against the sum of kernel times of the
   same step run eagerly under ``torch.profiler``: their gap is launch and idle time inside a step;
2. per kernel name: calls per step, µs per step, share of the step — the table fusion work starts
   from (how many small kernels per layer; how much time GEMMs take);
3. each projection's GEMM alone (``torch.matmul`` at the step's batch, weight [out, in] read once):
   µs, GB/s and % of the copy bandwidth measured in the same run — how far cuBLAS's small-M GEMMs
   are from the memory roofline.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line  # noqa: E402
from llm import BLOCK, SHAPES, _decode_inputs  # noqa: E402


def projections(c: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder-layer projection and the lm head, from an HF config dict."""
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, kv, hid, inter = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"], c["intermediate_size"]
    return {"qkv": ((h + 2 * kv) * d, hid), "o": (hid, h * d), "gate_up": (2 * inter, hid), "down": (hid, inter),
            "lm_head": (c["vocab_size"], hid)}


def gemm_table(c: dict, batch: int, copy_gbs: float) -> list[str]:
    rows = ["| projection | weight [out, in] | µs | GB/s | % of copy |", "|---|---|---:|---:|---:|"]
    for name, (n, k) in projections(c).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
        ms = bench_ms(lambda: torch.matmul(x, w.T, out=out))
        gbs = (n * k + batch * (n + k)) * 2 / (ms * 1e-3) / 1e9
        rows.append(f"| {name} | [{n}, {k}] | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f}% |")
        del w, x, out
    return rows


def kernel_table(llm, inputs: dict, steps: int = 5) -> tuple[list[str], float]:
    from torch.profiler import ProfilerActivity, profile

    from graphdsl.layers import Phase
    llm.model.configure_runtime(cuda_graphs=False)
    for _ in range(2):
        llm.model.execute(Phase.DECODE, inputs, float_logits=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.model.execute(Phase.DECODE, inputs, float_logits=False)
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None)
        if us is None:
            us = getattr(evt, "cuda_time_total", 0.0)
        if us <= 0 or evt.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")):
            continue
        per[evt.key][0] += evt.count / steps
        per[evt.key][1] += us / steps
    total = sum(v[1] for v in per.values())
    rows = ["| kernel | calls/step | µs/step | share |", "|---|---:|---:|---:|"]
    for key, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
        rows.append(f"| `{key[:70]}` | {calls:.0f} | {us:.1f} | {100 * us / total:.1f}% |")
    llm.model.configure_runtime(cuda_graphs=True)
    return rows, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import graphdsl as gd
    from graphdsl.layers import Phase
    hf = SHAPES[args.shape]
    copy = copy_bandwidth_gbs()
    print(f"## decode profile: {args.shape}, batch {args.batch}, context {args.context} — {device_line()}")
    print(f"copy bandwidth measured here: {copy:.0f} GB/s\n")
    llm = gd.LLM.from_config(hf, device="cuda", dtype="bfloat16", seed=0, max_model_len=args.context + 1,
                             max_num_seqs=args.batch, block_size=BLOCK)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs, _ = _decode_inputs(llm, args.batch, args.context, gen)
    step_ms = bench_ms(lambda: llm.model.execute(Phase.DECODE, inputs, float_logits=False))
    rows, kernel_us = kernel_table(llm, inputs)
    print(f"graph-replayed step: {step_ms * 1e3:.0f} µs; kernels of the eager step sum to {kernel_us:.0f} µs "
          f"({100 * kernel_us / (step_ms * 1e3):.0f}% of the replayed step)\n")
    print("\n".join(rows) + "\n")
    print("\n".join(gemm_table(hf, args.batch, copy)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
