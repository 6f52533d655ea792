"""The sampler on the GPU: time of ``sample`` (and ``compute_logprobs``) per call for real vocabulary
sizes, as GPU time (CUDA events around many calls) and as host time (launching only, no sync),
with the bytes of logits it must read at least once.

    python benchmarks/sampling.py [--vocab 128256] [--rows 1 64 256]

Rows whose sampled rows all have a top-k run ``kernels.topk_draw`` (two launches); they are timed
again with ``torch.topk`` and the threshold kernel (``sampler.TOPK_DRAW = False``), marked so.
GPU time is measured by replaying one captured call (so launch gaps do not count), host time by
launching calls back to back. Each ``sample`` call also counts its tokens for the penalties and
writes them into a next-step input buffer, as the serving loop's calls do. A sampler whose host time exceeds a decode step's GPU time stalls the
overlapped loop; its GPU time adds to every step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line  # noqa: E402

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k 50 + top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "+ presence/frequency": dict(temperature=0.8, top_k=50, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5),
    "top-p 0.9 only (full sort)": dict(temperature=0.8, top_p=0.9),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
}


def _rows(kw: dict, n: int, penalties: bool) -> list[dict]:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0)
    return [dict(base, **kw, seed=i, slot=i if penalties else -1) for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/sampling.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from graphdsl.runtime.serving import sampler
    from graphdsl.runtime.serving.sampler import PenaltyState, SamplingTensors, compute_logprobs, sample
    dev = torch.device("cuda")
    V = args.vocab
    print(f"{device_line()}; vocab {V}")
    print("| case | rows | GPU us/call | host us/call | logits GB/s (one read) |")
    print("|---|---:|---:|---:|---:|")
    for R in args.rows:
        logits = torch.randn(R, V, device=dev) * 3
        pen = PenaltyState(R, V, dev)
        for r in range(R):
            pen.reset(r, list(range(r, r + 50)), list(range(100, 120)))
        ctr = torch.arange(R, dtype=torch.int64, device=dev)
        ids = torch.zeros(R, dtype=torch.int64, device=dev)
        # as the serving loop calls it: the draw also counts the tokens and writes the next inputs
        cases = [(name, lambda st, x: sample(x, st, ctr, penalties=pen if st.any_penalty else None, record=True,
                                             into=ids), True)
                 for name in CASES]
        # the rows with a top-k again, through torch.topk and the threshold kernel instead of kernels.topk_draw
        cases += [(name, cases[0][1], False) for name in CASES if CASES[name].get("top_k")]
        cases.append(("compute_logprobs(5)", None, True))
        for name, fn, topk_draw in cases:
            sampler.TOPK_DRAW = topk_draw
            kw = CASES.get(name, {})
            st = SamplingTensors.build(_rows(kw, R, "presence_penalty" in kw), dev)
            toks = torch.zeros(R, dtype=torch.int64, device=dev)
            call = (lambda: fn(st, logits.clone())) if fn else (lambda: compute_logprobs(logits, toks, 5))
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            t0 = time.perf_counter()                      # host: launching only
            for _ in range(args.iters):
                call()
            host_us = (time.perf_counter() - t0) / args.iters * 1e6
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()                # GPU: replays of one captured call
            with torch.cuda.graph(graph):
                call()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            gpu_us = start.elapsed_time(end) / args.iters * 1e3
            if not topk_draw:
                name += " (torch.topk)"
            print(f"| {name} | {R} | {gpu_us:.1f} | {host_us:.1f} | {R * V * 4 / (gpu_us * 1e-6) / 1e9:.0f} |",
                  flush=True)
    print("(GPU time includes a clone of the logits per call for the sample cases: "
          "R x V x 8 bytes of copy traffic)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
