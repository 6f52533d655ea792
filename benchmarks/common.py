"""The two ceilings every benchmark here compares against, measured on the device in the same run,
and the one timing helper they share.

* :func:`copy_bandwidth_gbs` — a device-to-device copy of 1 GiB (bf16): (bytes read + bytes
  written) / median time. The memory-bound ceiling (decode, fused pointwise kernels).
* :func:`matmul_tflops` — a bf16 ``torch.matmul`` of two random 8192 x 8192 matrices (cuBLAS):
  2 n^3 / median time. The compute-bound ceiling (prefill).

:func:`generate_s` times the public entry point: one greedy ``LLM.generate`` call, wall clock.

Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between repetitions),
after a warm-up call; :func:`bench_ms` takes the median of ``repeats`` such medians, which is stable
to a few percent where one do_bench median moved by up to 2x on a slow-launching host.
"""
from __future__ import annotations

import torch

__all__ = ["bench_ms", "copy_bandwidth_gbs", "matmul_tflops", "device_line", "generate_s", "at_least"]


def bench_ms(fn, *, repeats: int = 3, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Milliseconds: the median of ``repeats`` do_bench medians, after one warm-up call."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    runs = sorted(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
                  for _ in range(repeats))
    return runs[len(runs) // 2]


def graph_ms(fn, *, repeats: int = 3, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Milliseconds per replay of ``fn`` captured in one CUDA graph (:func:`bench_ms` of the replay),
    after one call outside the graph so autotuners and allocations settle."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = bench_ms(g.replay, repeats=repeats, warmup_ms=warmup_ms, rep_ms=rep_ms)
    del g
    return ms


def generate_s(llm, prompt: list[int] | list[list[int]], new_tokens: int) -> float:
    """Wall seconds of ``llm.generate([prompt])`` making ``new_tokens`` greedy tokens (``ignore_eos``),
    the device synchronised before and after; per-token times are differences of two such calls.
    ``prompt`` may be a list of prompts: one batch of that many sequences."""
    import time

    import graphdsl as gd
    prompts = [prompt] if prompt and isinstance(prompt[0], int) else prompt
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, gd.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def copy_bandwidth_gbs(nbytes: int = 1 << 30, device="cuda") -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (random bf16): (read + written bytes) / time."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, device="cuda") -> float:
    """TFLOP/s of a bf16 ``torch.matmul`` of two random ``n x n`` matrices: 2 n^3 / time."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: torch.matmul(a, b, out=c))
    del a, b, c
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def device_line() -> str:
    import triton
    return f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}"


def at_least(low: int):
    """An argparse ``type``: an integer ``>= low``, else an error naming the expected and given value."""
    import argparse

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return v
    return parse
