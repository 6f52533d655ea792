"""Where a graph-replayed decode step's time goes: each kernel's share of the critical path.

    python benchmarks/decode_timeline.py --shape llama-3.2-1b [--context 512] [--steps 5] [--batch 1]
                                         [--quantization int4]

With programmatic dependent launch a kernel starts while its predecessor runs and then waits, so
kernel *durations* overlap and do not add up to the step. What does add up is each kernel's
**increment**: its end time minus the latest end time of the kernels before it. This script
replays ``--steps`` decode steps of ``--batch`` sequences (what ``LLM`` runs) under ``torch.profiler``, sorts the
recorded kernels by start time, and prints per kernel family: calls per step, increment per step
and per call, and the mean duration; then one layer's kernels in order (start, end, duration
relative to the layer's first kernel). Increments of kernels outside the graph (input copies) also
include host time, which the profiler inflates. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line  # noqa: E402
from llm import SHAPES, batch_decode  # noqa: E402
from quant import _ActOrder, _GGUFMix  # noqa: E402

FAMILIES = ("_gemv_kernel", "_decode_kernel", "_rope_cache_kernel", "fused_kernel", "nvjet", "gemm",
            "_reshape_and_cache")


def family(name: str) -> str:
    """A kernel's family: the engine's kernel names, else the first 50 characters of its signature."""
    name = name.split("(")[0]
    return next((f for f in FAMILIES if f in name), name[:50])


def kernel_events(llm, inputs: dict, steps: int) -> list[dict]:
    """Chrome-trace kernel events (``ts``, ``dur`` in µs, ``name``) of ``steps`` decode steps, by start."""
    from torch.profiler import ProfilerActivity, profile

    from graphdsl.layers import Phase
    for _ in range(5):
        llm.model.execute(Phase.DECODE, inputs, float_logits=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.model.execute(Phase.DECODE, inputs, float_logits=False)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def increments(events: list[dict]) -> tuple[dict, dict, collections.Counter]:
    """Per family: summed critical-path increments, summed durations, call counts."""
    inc, dur, calls = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
    last_end = None
    for e in events:
        f, end = family(e["name"]), e["ts"] + e["dur"]
        calls[f] += 1
        dur[f] += e["dur"]
        if last_end is not None:
            inc[f] += max(0.0, end - last_end)
        last_end = end if last_end is None else max(last_end, end)
    return inc, dur, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1, help="sequences a step (each at --context)")
    ap.add_argument("--quantization", default=None,
                    help="LLM(quantization=...): int4, fp8, ..., gguf-q4_k_m or gguf-q5_k_m (quant.py's mixes)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_timeline.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import graphdsl as gd
    with _GGUFMix(), _ActOrder():         # gguf-q4_k_m: the Q4_K_M mix; int4-g128-act: random act order
        llm, inputs = batch_decode(gd, args.shape, args.context, args.quantization, batch=args.batch)
    events = kernel_events(llm, inputs, args.steps)
    inc, dur, calls = increments(events)
    n = args.steps
    quant = f", {args.quantization}" if args.quantization else ""
    print(f"## {args.shape}{quant} batch {args.batch}, ctx {args.context} — {device_line()}\n")
    print(f"sum of increments {sum(inc.values()) / n:.0f} µs/step over {len(events) / n:.0f} kernels/step\n")
    print("| kernel | calls/step | increment µs/step | increment µs/call | mean duration µs |")
    print("|---|---:|---:|---:|---:|")
    for f, v in sorted(inc.items(), key=lambda kv: -kv[1]):
        print(f"| `{f}` | {calls[f] / n:.0f} | {v / n:.1f} | {v / calls[f]:.2f} | {dur[f] / calls[f]:.2f} |")
    per_step = len(events) // n
    _print_kernels("one layer from the middle of the first step", events[per_step // 2: per_step // 2 + 14])
    _print_kernels("the first step's first kernels (before the first layer)", events[:6])
    _print_kernels("the first step's last kernels (after the last layer)", events[per_step - 8: per_step])
    return 0


def _print_kernels(title: str, events: list[dict]) -> None:
    t0 = events[0]["ts"]
    print(f"\n{title} (µs from its first kernel):\n")
    for e in events:
        print(f"    {family(e['name']):<20} start {e['ts'] - t0:7.1f}  end {e['ts'] + e['dur'] - t0:7.1f}"
              f"  duration {e['dur']:6.1f}")


if __name__ == "__main__":
    sys.exit(main())
