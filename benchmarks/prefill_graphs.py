"""Prefill steps of short prompts, eager against replayed CUDA graphs (``GRAPHDSL_PREFILL_GRAPHS``),
and the time to the first token through ``LLM.generate`` both ways (random weights).

    python benchmarks/prefill_graphs.py [--shape llama-3.2-1b] [--tokens 16 128 512 2048] [--prompt 127]

A prefill step run eagerly pays one host launch per node, about 210 nodes on the 1B shape, which
costs more host time than the device needs for a short prompt (docs/performance-log.md, "The 1B
prefill is bound by the host"). By default (``GRAPHDSL_PREFILL_GRAPHS`` not 0) a step shape seen
before, of at most ``PREFILL_GRAPH_ROWS`` tokens, replays a CUDA graph
(``runtime/serving/cuda_graphs.ShapeGraphRunner``); this script sets the variable to 0 and 1 in turn. Per token count: ms per
``execute(Phase.PREFILL)`` call, wall clock with the device synchronised after 20 calls (host and
device both count: that is what a serving step waits for), best of two interleaved rounds per mode.
Then ``LLM.generate`` of one greedy token for one prompt of ``--prompt`` tokens: median of 6 calls
after 2 warm-up calls, per mode. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line  # noqa: E402
from llm import SHAPES, _free, _make_llm, _prefill_inputs, random_kv  # noqa: E402

_CALLS = 20


def _step_ms(llm, inputs) -> float:
    from graphdsl.layers import Phase
    for _ in range(3):                        # the first sight of a shape runs eagerly, the second captures
        llm.model.execute(Phase.PREFILL, inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(_CALLS):
        llm.model.execute(Phase.PREFILL, inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / _CALLS * 1e3


def _first_token_ms(llm, prompt: list[int]) -> float:
    import graphdsl as gd
    params = gd.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 2048], help="prefill token counts")
    ap.add_argument("--prompt", type=int, default=127, help="prompt tokens of the LLM.generate figure")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_graphs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if any(t < 1 for t in args.tokens) or args.prompt < 1:
        ap.error(f"--tokens and --prompt must be positive, got {args.tokens} and {args.prompt}")
    import graphdsl as gd
    before = os.environ.get("GRAPHDSL_PREFILL_GRAPHS")
    llm = _make_llm(gd, SHAPES[args.shape], "cuda", "bfloat16", 2049, 8, 8 * (2048 // 16 + 2))
    random_kv(llm)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{args.shape} (random weights, bf16) on {device_line()}\n")
    print("| figure | eager ms | CUDA graph ms | eager / graph |\n|---|---:|---:|---:|")
    try:
        for n in args.tokens:
            inputs, ids = _prefill_inputs(llm, n, gen)
            ms: dict[str, list[float]] = {"0": [], "1": []}
            for mode in ("0", "1", "0", "1"):
                os.environ["GRAPHDSL_PREFILL_GRAPHS"] = mode
                ms[mode].append(_step_ms(llm, inputs))
            _free(llm, ids)
            e, g = min(ms["0"]), min(ms["1"])
            print(f"| prefill step, {n} tokens | {e:.3f} | {g:.3f} | {e / g:.2f}x |", flush=True)
        prompt = torch.randint(0, llm.config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1))
        first = {}
        for mode in ("0", "1"):
            os.environ["GRAPHDSL_PREFILL_GRAPHS"] = mode
            first[mode] = _first_token_ms(llm, prompt.tolist())
        print(f"| LLM.generate, 1 token, prompt {args.prompt} | {first['0']:.3f} | {first['1']:.3f} | "
              f"{first['0'] / first['1']:.2f}x |")
    finally:
        if before is None:
            os.environ.pop("GRAPHDSL_PREFILL_GRAPHS", None)
        else:
            os.environ["GRAPHDSL_PREFILL_GRAPHS"] = before
    return 0


if __name__ == "__main__":
    sys.exit(main())
