"""One figure, quickly: the CUDA-graph-replayed batch-1 decode step of a real shape, and its % of
the roofline, under whatever ``GRAPHDSL_PDL`` / ``GRAPHDSL_DISABLE_PASSES`` are set — for A/B runs
of one decode optimisation at a time (``benchmarks/llm.py`` is the full report).

    GRAPHDSL_PDL=0 python benchmarks/decode_step.py --shape llama-3.2-1b [--batch 1] [--context 512]

Roofline as in ``llm.py``: (every weight but the embedding table + the KV cache read) / copy
bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line, matmul_tflops  # noqa: E402
from llm import (BLOCK, SHAPES, _decode_inputs, _drop_engines, decode_bytes, expert_fraction, kv_bytes_per_token,  # noqa: E402
                 random_kv, weight_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2049,
                    help="bounds the block-table width the decode graph is captured with (llm.py: 2049)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="KV pool / graph buckets for this many "
                    "sequences (llm.py: 256; default: --batch)")
    ap.add_argument("--rebuild", action="store_true", help="run one step, drop the engines and graphs, and "
                    "rebuild them (from the disk cache when it is on) before timing, as llm.py does")
    ap.add_argument("--after-matmul", action="store_true", help="run the bf16 matmul-rate measurement first, "
                    "as llm.py does")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import graphdsl as gd
    from graphdsl.layers import Phase
    copy = copy_bandwidth_gbs()
    if args.after_matmul:
        matmul_tflops()
    llm = gd.LLM.from_config(SHAPES[args.shape], device="cuda", dtype="bfloat16", seed=0,
                             max_model_len=max(args.max_model_len, args.context + 1), max_num_seqs=args.max_num_seqs or args.batch,
                             block_size=BLOCK)
    random_kv(llm)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs, _ = _decode_inputs(llm, args.batch, args.context, gen)
    if args.rebuild:
        llm.model.execute(Phase.DECODE, inputs, float_logits=False)
        _drop_engines(llm)
    ms = bench_ms(lambda: llm.model.execute(Phase.DECODE, inputs, float_logits=False))
    nbytes = decode_bytes(weight_bytes(llm.model), kv_bytes_per_token(llm), args.batch, args.context,
                          expert_fraction(llm.config, args.batch))
    roof = nbytes / (copy * 1e9) * 1e3
    env = {k: os.environ[k] for k in ("GRAPHDSL_PDL", "GRAPHDSL_DISABLE_PASSES") if k in os.environ}
    extra = f" max_num_seqs {args.max_num_seqs}" if args.max_num_seqs else ""
    extra += " rebuilt" if args.rebuild else ""
    extra += " after-matmul" if args.after_matmul else ""
    print(f"{args.shape} batch {args.batch} ctx {args.context} max_model_len {args.max_model_len}{extra} {env or '(defaults)'}: {ms * 1e3:.0f} µs/step = "
          f"{100 * roof / ms:.1f}% of roofline ({roof * 1e3:.0f} µs at {copy:.0f} GB/s) — {device_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
