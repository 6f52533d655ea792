"""What a prefill at a token count the engine has not seen costs, against one it has (random weights).

    python benchmarks/prefill_shapes.py [--shape llama-3-8b] [--lengths 200 ...]

A plan (shapes, memory) and the backend's prepared kernels are kept per input-shape signature, so
the first prefill of a new length pays for specialising them; the serving loop pads prefill steps
to a few token-count buckets so that this is paid once per bucket. Prints, per length: ms of the
first call (new shape), ms of a repeat (cached), and their difference.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line  # noqa: E402
from llm import BLOCK, SHAPES, _free, _make_llm, _prefill_inputs  # noqa: E402


def main(argv=None) -> int:
    import graphdsl as gd
    from graphdsl.layers import Phase
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--lengths", type=int, nargs="+", default=[200, 201, 203, 250, 511, 777])
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print the top N functions (cumulative time) of one new-shape call")
    args = ap.parse_args(argv)
    llm = _make_llm(gd, SHAPES[args.shape], "cuda", "bfloat16", 2049, 4, 4 * (2048 // BLOCK + 2))
    gen = torch.Generator(device="cuda").manual_seed(0)
    warm, ids = _prefill_inputs(llm, 64, gen)
    llm.model.execute(Phase.PREFILL, warm)
    _free(llm, ids)
    print(f"{args.shape} prefill on {device_line()}\n")
    print("| tokens | first call (new shape) ms | repeat ms | specialisation ms |\n|---:|---:|---:|---:|")
    for n in args.lengths:
        times = []
        for _ in range(2):
            inputs, ids = _prefill_inputs(llm, n, gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.model.execute(Phase.PREFILL, inputs)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            _free(llm, ids)
        print(f"| {n} | {times[0]:.1f} | {times[1]:.1f} | {times[0] - times[1]:.1f} |", flush=True)
    if args.profile:
        import cProfile
        import pstats
        inputs, ids = _prefill_inputs(llm, max(args.lengths) + 3, gen)
        prof = cProfile.Profile()
        prof.enable()
        llm.model.execute(Phase.PREFILL, inputs)
        torch.cuda.synchronize()
        prof.disable()
        _free(llm, ids)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
