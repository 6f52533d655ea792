"""Tensor-parallel batch-1 decode: Llama-3-8B shape at TP1 and TP2, and a Llama-3-70B shape (80 layers,
random weights) at TP2, in ms/token and as % of each rank's roofline.

    python3 benchmarks/tp.py [--tp 2] [--shapes llama-3-8b llama-3-70b] [--tokens 128] [--no-graphs]

Decode time per token = (time to generate ``16 + tokens`` tokens − time to generate 16) / tokens,
through ``LLM.generate`` (the serving loop, step announcement to the workers included), median of
three. TP>1 runs twice: decode steps eager, and replayed through CUDA graphs that capture the
collectives (``GRAPHDSL_TP_CUDA_GRAPHS=1``; ``--no-graphs`` skips those rows). Set
``GRAPHDSL_ALLREDUCE=symm_mem`` to time the one-shot all-reduce instead of NCCL's. Roofline per
rank = (the rank's weights except its embedding shard + its KV cache at the mean context) ÷ measured device-to-device copy bandwidth; collectives are not in the roofline, so the %
shows what they and the step announcement cost. NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, set here before torch loads).
"""
from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, device_line, generate_s  # noqa: E402
from llm import SHAPES  # noqa: E402

SHAPES = dict(SHAPES)
SHAPES["llama-3-70b"] = dict(SHAPES["llama-3-8b"], hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=8)
PROMPT = 32
WARM = 16


def rank_bytes(llm, context: int) -> int:
    """Bytes rank 0 reads per decode token: its parameters but the embedding shard, and its KV
    cache at ``context`` tokens."""
    elem = torch.empty((), dtype=llm.dtype).element_size()
    weights = sum(math.prod(p.shape) * elem for name, p in llm.model.named_parameters()
                  if name != "model.embed_tokens.weight")
    kv = llm.kv_cache.key_caches[0]
    kv_per_token = 2 * len(llm.kv_cache.key_caches) * kv.shape[2] * kv.shape[3] * kv.element_size()
    return weights + context * kv_per_token


def decode_ms(llm, tokens: int) -> float:
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(PROMPT)]
    generate_s(llm, prompt, WARM + tokens)           # build + capture
    times = [(generate_s(llm, prompt, WARM + tokens) - generate_s(llm, prompt, WARM)) * 1e3 / tokens
             for _ in range(3)]
    return statistics.median(times)


def measure(shape: str, tp: int, tokens: int, graphs: bool, copy: float) -> dict:
    import graphdsl as gd
    saved = os.environ.get("GRAPHDSL_TP_CUDA_GRAPHS")
    os.environ["GRAPHDSL_TP_CUDA_GRAPHS"] = "1" if graphs else "0"
    try:
        llm = gd.LLM.from_config(SHAPES[shape], device="cuda", dtype="bfloat16", seed=0,
                                 max_model_len=PROMPT + WARM + tokens + 16, max_num_seqs=1,
                                 tensor_parallel_size=tp)
        try:
            ms = decode_ms(llm, tokens)
            roof_ms = rank_bytes(llm, PROMPT + WARM + tokens // 2) / (copy * 1e9) * 1e3
        finally:
            llm.close()
            del llm
            torch.cuda.empty_cache()
    finally:
        if saved is None:
            os.environ.pop("GRAPHDSL_TP_CUDA_GRAPHS", None)
        else:
            os.environ["GRAPHDSL_TP_CUDA_GRAPHS"] = saved
    return {"shape": shape, "tp": tp, "graphs": graphs or tp == 1, "ms": ms, "roof_ms": roof_ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["llama-3-8b", "llama-3-70b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="skip the TP>1 rows with decode CUDA graphs capturing the collectives")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        print(f"tp.py needs {args.tp} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    copy = copy_bandwidth_gbs()
    rows = []
    for shape in args.shapes:
        runs = ([(1, True)] if shape == "llama-3-8b" else []) + [(args.tp, False)] + ([(args.tp, True)] if args.graphs else [])
        for tp, graphs in runs:
            try:
                rows.append(measure(shape, tp, args.tokens, graphs, copy))
            except Exception as e:           # one failing configuration still leaves the others' rows
                print(f"{shape} TP{tp} graphs={graphs}: failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                rows.append({"shape": shape, "tp": tp, "graphs": graphs, "ms": float("nan"), "roof_ms": float("nan")})
    print(f"# tensor-parallel batch-1 decode — {device_line()}; copy {copy:.0f} GB/s per GPU")
    print("| shape | TP | decode CUDA graphs | ms/token | roofline ms/token (per rank) | % of roofline | vs TP1 |")
    print("|---|---|---|---|---|---|---|")
    base = {r["shape"]: r["ms"] for r in rows if r["tp"] == 1}
    for r in rows:
        rel = f"{r['ms'] / base[r['shape']]:.2f}x" if r["shape"] in base else "—"
        print(f"| {r['shape']} | {r['tp']} | {'yes' if r['graphs'] else 'no'} | {r['ms']:.2f} | {r['roof_ms']:.2f} | "
              f"{100 * r['roof_ms'] / r['ms']:.0f}% | {rel} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
