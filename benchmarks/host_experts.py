"""Experts on the host (``CPUExperts``): one expert's gate/up product for a few bf16 rows, its stack
stored in bf16, int8 or int4 (``models/cpu_experts.HostStack``: torch's CPU weight-only kernels for
the codes), µs a call and the speed against bf16. Runs on any machine (no GPU needed).

    python benchmarks/host_experts.py [--shape deepseek-v2-lite|mixtral|qwen2-moe] [--rows 1 2 8] [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

# hidden, intermediate of one expert (published configs)
SHAPES = {"deepseek-v2-lite": (2048, 1408), "qwen2-moe": (2048, 1408), "mixtral": (4096, 14336)}
SCHEMES = ("int8-channel", "int4-g128")


def _us(fn, rounds: int = 30) -> float:
    """Median µs of ``rounds`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e6


def main(argv=None) -> int:
    from graphdsl.models.cpu_experts import HostStack
    from graphdsl.quant import parse_scheme
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="deepseek-v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, inter = SHAPES[args.shape]
    w = torch.randn(2, 2 * inter, hidden, generator=torch.Generator().manual_seed(0)) * 0.02   # two experts
    stacks = {"bf16": HostStack(None, [w.bfloat16()], (2 * inter, hidden))}
    for name in SCHEMES:
        s = parse_scheme(name)
        stacks[name] = HostStack(s, s.quantize_stack(w, torch.bfloat16), (2 * inter, hidden))
    print(f"{args.shape}: one expert's gate/up [{2 * inter}, {hidden}]; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| rows | weights | MB an expert | µs | x bf16 speed |\n|---:|---|---:|---:|---:|")
    for rows in args.rows:
        h = torch.randn(rows, hidden).bfloat16()
        base = None
        for name, st in stacks.items():
            mb = st.nbytes() / st.experts / 1e6
            us = _us(lambda: st.mm(1, h))
            base = base or us
            print(f"| {rows} | {name} | {mb:.3g} | {us:.0f} | {base / us:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
