"""CPU expert offload (optimize rule ``moe-experts-cpu``) against the all-GPU model: batch-1 decode
ms/token, the GPU memory the routed experts no longer take, and whether greedy tokens agree.

    python benchmarks/injection.py [--layers 24] [--context 512] [--threads 16] [--dtype bfloat16]

Shape: Qwen1.5-MoE-A2.7B (``qwen2_moe``: 60 experts of 1408, top-4, a 5632 shared expert, hidden
2048), random weights (seed 0) — the same weights in both runs. ``--layers N`` keeps the first N
decoder layers (a smaller GPU or a quicker run). The CPU row's time includes the two host copies
per MoE layer (activations out, results back) and the host GEMMs of the routed experts.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, device_line  # noqa: E402
from llm import BLOCK, _decode_inputs, random_kv  # noqa: E402

QWEN2_MOE = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=2048,
                 intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                 vocab_size=151936, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                 shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1,
                 tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16")


def measure(hf: dict, rules, *, device: str = "cuda", dtype: str = "bfloat16", context: int = 512,
            tokens: int = 16, timer=None) -> dict:
    """One model of ``hf`` with ``rules`` (None: as is): ``ms`` (a batch-1 decode step at
    ``context`` cached tokens, timed by ``timer(fn) -> ms``; default: CUDA-event medians),
    ``resident`` (device bytes the model and its KV cache took), ``load_s``, and ``tokens``
    greedy tokens of a fixed prompt."""
    import graphdsl as gd
    from graphdsl.layers import Phase
    cuda = torch.device(device).type == "cuda"
    timer = timer or (lambda fn: bench_ms(fn, repeats=3, warmup_ms=50, rep_ms=500))
    if cuda:
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.monotonic()
    llm = gd.LLM.from_config(hf, device=device, dtype=dtype, seed=0, max_model_len=context + 64, max_num_seqs=1,
                             num_kv_blocks=2 * (context // BLOCK + 2), block_size=BLOCK, optimize_rules=rules)
    load_s = time.monotonic() - t0
    resident = (torch.cuda.memory_allocated() - base) if cuda else 0
    params = gd.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out_tokens = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    random_kv(llm)
    gen = torch.Generator(device=device).manual_seed(0)
    inputs, _ = _decode_inputs(llm, 1, context, gen)
    ms = timer(lambda: llm.model.execute(Phase.DECODE, inputs, float_logits=False))
    out = dict(ms=ms, resident=resident, load_s=load_s, tokens=out_tokens)
    del llm, inputs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def table(gpu: dict, cpu: dict, *, layers: int, dtype: str, context: int, threads: int, device: str) -> str:
    gib = 2 ** 30
    lines = [f"# CPU expert offload, Qwen1.5-MoE-A2.7B shape, {layers} layers, {dtype}, batch 1, context {context}",
             f"# {device}; host threads {threads}",
             f"| {'experts on':<10} | {'decode ms/token':>15} | {'GPU resident GiB':>16} | {'load s':>7} |",
             f"|{'-' * 12}|{'-' * 16}:|{'-' * 17}:|{'-' * 8}:|"]
    for name, r in (("GPU", gpu), ("CPU", cpu)):
        lines.append(f"| {name:<10} | {r['ms']:>15.2f} | {r['resident'] / gib:>16.2f} | {r['load_s']:>7.1f} |")
    saved = gpu["resident"] - cpu["resident"]
    lines.append(f"GPU memory saved: {saved / gib:.2f} GiB ({100 * saved / max(gpu['resident'], 1):.0f}% of the "
                 f"all-GPU model); CPU/GPU decode time {cpu['ms'] / gpu['ms']:.1f}x")
    same = gpu["tokens"] == cpu["tokens"]
    lines.append(f"greedy tokens ({len(gpu['tokens'])}) equal: {same}"
                 + ("" if same else f"\n  GPU {gpu['tokens']}\n  CPU {cpu['tokens']}"))
    return "\n".join(lines)


def experts_cpu_rules(threads: int | None = None) -> list:
    """The shipped ``moe-experts-cpu`` rules, with ``threads`` for the host GEMMs."""
    from graphdsl.models.injection import builtin_rules, load_rules
    rules = load_rules(builtin_rules("moe-experts-cpu"))
    if threads:
        rules[0].replace.kwargs["threads"] = threads
    return rules


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=QWEN2_MOE["num_hidden_layers"], help="decoder layers kept (<= 24)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens the timed decode step attends over")
    ap.add_argument("--threads", type=int, default=None, help="host threads for the CPU experts (default: torch's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens compared between the two runs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("injection.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if not 1 <= args.layers <= QWEN2_MOE["num_hidden_layers"]:
        ap.error(f"--layers must be in [1, {QWEN2_MOE['num_hidden_layers']}], got {args.layers}")
    hf = dict(QWEN2_MOE, num_hidden_layers=args.layers)
    kw = dict(device="cuda", dtype=args.dtype, context=args.context, tokens=args.tokens)
    gpu = measure(hf, None, **kw)
    cpu = measure(hf, experts_cpu_rules(args.threads), **kw)
    print(table(gpu, cpu, layers=args.layers, dtype=args.dtype, context=args.context,
                threads=args.threads or torch.get_num_threads(), device=device_line()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
