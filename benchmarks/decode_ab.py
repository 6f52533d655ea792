"""Interleaved A/B of decode passes: one model per pass configuration in one process, their decode
steps (batch 1, or ``--batch N`` sequences) timed in alternation, so slow drifts of the device (clocks, placement) hit every
variant alike — separate processes differed by up to 10% with identical code on the H200.

    python benchmarks/decode_ab.py --shape llama-3-8b --variants "" matmul_norm gate_up_silu \
        matmul_norm,gate_up_silu [--rounds 5]

Each variant is a ``GRAPHDSL_DISABLE_PASSES`` value ("" = every pass), optionally followed by
``;NAME=VALUE`` environment settings (``"rope_cache_attention;GRAPHDSL_PDL=0"``) and
``;module:attr=VALUE`` patches of a module constant (a Python literal:
``";graphdsl.runtime.kernels.paged_attention:_MIN_KEYS_PER_SPLIT=256"``, or ``@module:attr``, an
object of another module importable from the working directory, e.g. an older version of a
function kept beside the benchmark), set while its engines are built and captured (a captured
graph keeps the launches it was captured with). Prints each variant's median µs per step and % of
the roofline (as in ``llm.py``; with ``--quantization`` the weights count as stored, as in
``quant.py``). Two builds of the same code differ by up to ~0.6% (weights and arena at other
addresses; docs/performance-log.md), more than the rounds' spread: to judge a smaller change, build
each variant twice or more (``--builds 2``: the builds interleaved, the table showing each build's
median and their mean). The int4 GEMV's integer-dot row loop (the default) against its
float loop:

    python benchmarks/decode_ab.py --shape llama-3-8b --quantization int4 \
        --variants "" ";graphdsl.runtime.kernels.gemv:_INT4_INT_DOT=False"
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line  # noqa: E402
from llm import SHAPES, batch_decode, decode_bytes, kv_bytes_per_token, weight_bytes  # noqa: E402
from quant import _ActOrder, _GGUFMix  # noqa: E402


def _value(text: str):
    """A patch's value: ``@module:attr`` names an object of another module, anything else is a literal."""
    if text.startswith("@"):
        mod, attr = text[1:].split(":", 1)
        return getattr(importlib.import_module(mod), attr)
    return ast.literal_eval(text)


def _build(gd, variant: str, args):
    """One model for ``variant`` (module docstring), built and its decode graph captured under the
    variant's passes, environment and patches, which are undone afterwards: ``(llm, inputs)``."""
    from graphdsl.layers import Phase
    passes, *settings = variant.split(";")
    pairs = [s.split("=", 1) for s in settings]
    env = {k: val for k, val in pairs if ":" not in k}
    patches = [(importlib.import_module(k.split(":")[0]), k.split(":")[1], _value(val))
               for k, val in pairs if ":" in k]
    saved = {k: os.environ.get(k) for k in env}
    saved_attrs = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patches]
    os.environ.update(env, GRAPHDSL_DISABLE_PASSES=passes)
    for mod, attr, val in patches:
        setattr(mod, attr, val)
    try:
        with _GGUFMix(), _ActOrder():     # gguf-q4_k_m: the Q4_K_M mix; int4-g128-act: random act order (quant.py)
            llm, inputs = batch_decode(gd, args.shape, args.context, args.quantization, args.batch)
        llm.model.execute(Phase.DECODE, inputs, float_logits=False)   # build + capture under these settings
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k)
            else:
                os.environ[k] = old
        for mod, attr, old in saved_attrs:
            setattr(mod, attr, old)
        os.environ.pop("GRAPHDSL_DISABLE_PASSES", None)
    return llm, inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--variants", nargs="+", default=["", "matmul_norm,gate_up_silu"],
                    help="GRAPHDSL_DISABLE_PASSES values [;NAME=VALUE...], one model each")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1, help="sequences a step (each at --context)")
    ap.add_argument("--builds", type=int, default=1,
                    help="models built per variant (interleaved); the table gives the mean of their medians")
    ap.add_argument("--quantization", default=None,
                    help="LLM(quantization=...) for every variant: int4, fp8, ..., gguf-q4_k_m or gguf-q5_k_m (quant.py's mixes), "
                         "or int4-g128-act (act-order int4 in a random input order)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_ab.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import graphdsl as gd
    from graphdsl.layers import Phase
    copy = copy_bandwidth_gbs()
    runs = {}                          # (variant, build) -> (llm, inputs, times); builds interleaved
    for b in range(args.builds):
        for v in args.variants:
            runs[v, b] = (*_build(gd, v, args), [])
    for _ in range(args.rounds):
        for llm, inputs, times in runs.values():
            times.append(bench_ms(lambda: llm.model.execute(Phase.DECODE, inputs, float_logits=False), repeats=1))
    llm0 = runs[args.variants[0], 0][0]
    if args.quantization:
        from quant import stored_bytes
        roof = (stored_bytes(llm0) + kv_bytes_per_token(llm0) * args.context * args.batch) / (copy * 1e9) * 1e3
    else:
        roof = (decode_bytes(weight_bytes(llm0.model), kv_bytes_per_token(llm0), args.batch, args.context)
                / (copy * 1e9) * 1e3)
    print(f"## decode A/B, {args.shape}{', ' + args.quantization if args.quantization else ''}, batch {args.batch}, "
          f"ctx {args.context}, {args.rounds} interleaved rounds — "
          f"{device_line()}; copy {copy:.0f} GB/s, roofline {roof * 1e3:.0f} µs\n")
    print("| disabled passes; environment | median µs/step | % of roofline | min | max |"
          + (" median of each build |" if args.builds > 1 else ""))
    print("|---|---:|---:|---:|---:|" + ("---|" if args.builds > 1 else ""))
    for v in args.variants:
        times = [runs[v, b][2] for b in range(args.builds)]
        meds = [statistics.median(t) for t in times]
        med = statistics.mean(meds)
        row = (f"| {v or '(none)'} | {med * 1e3:.0f} | {100 * roof / med:.1f}% | {min(map(min, times)) * 1e3:.0f} | "
               f"{max(map(max, times)) * 1e3:.0f} |")
        print(row + (" " + ", ".join(f"{m * 1e3:.0f}" for m in meds) + " |" if args.builds > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
