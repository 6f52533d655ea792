"""LoRA serving cost on a real shape: base vs adapters, per decode step and end to end.

    python3 benchmarks/lora.py [--shape llama-3-8b] [--rank 16] [--adapters 8] [--context 512]

Random weights and random rank-``--rank`` adapters on every linear (q, k, v, o, gate, up, down).
Rows (issue 18 targets in brackets):

* engine, batch 1: the CUDA-graph decode step without LoRA vs with one adapter [<= 1.10x];
* engine, batch 64: base vs 64 rows spread over ``--adapters`` adapters [<= 1.25x];
* ``LLM.generate``: the same two comparisons end to end (prompts of 64 tokens, 128 new tokens
  each; wall time including prefill, graph replay and sampling).

The extra bytes a LoRA step reads (every used slot's A and B once) are printed beside the time
they cost at the measured copy bandwidth. A header line counts the LoRA decode graph's
projections by op: the ``lora_epilogue`` rules (``matmul_epilogue`` pass) put each adapter term
into its projection (``matmul_lora``, ``matmul_silu_mul_lora``, ``matmul_add_lora``: one shrink
launch more than the base projection up to 16 rows, two beyond); a ``lora_apply`` left over is a
projection the rules did not fuse.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import bench_ms, copy_bandwidth_gbs, device_line  # noqa: E402
from llm import BLOCK, SHAPES, _decode_inputs, random_kv  # noqa: E402

from tests.helpers.lora_files import write_random_adapter  # noqa: E402


def _lora_bytes(llm, used: int) -> int:
    """Bytes of ``used`` slots' factors (what a step with that many adapters reads at least)."""
    per_slot = sum(b.numel() // b.shape[0 if name.endswith(".A") else 1] for name, b in llm.model.lora.buffers.items())
    return per_slot * used * 2


def _generate_s(llm, prompts, params, loras) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-generate", action="store_true", help="engine rows only")
    ap.add_argument("--profile", action="store_true",
                    help="also print the per-kernel table of the eager batch step, base and LoRA")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("lora.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import graphdsl as gd
    from graphdsl.layers import Phase
    copy = copy_bandwidth_gbs()
    ctx = args.context
    blocks = (args.batch + 2) * (-(-(ctx + args.new_tokens + 64) // BLOCK) + 1)
    llm = gd.LLM.from_config(SHAPES[args.shape], device="cuda", dtype="bfloat16", seed=0, max_model_len=2049,
                             max_num_seqs=args.batch, num_kv_blocks=blocks, block_size=BLOCK)
    random_kv(llm)
    llm.enable_lora(max_loras=args.adapters, max_lora_rank=args.rank)
    tmp = tempfile.mkdtemp(prefix="graphdsl-lora-")
    names = [f"ad{i}" for i in range(args.adapters)]
    for i, n in enumerate(names):
        llm.load_lora(n, write_random_adapter(llm, os.path.join(tmp, n), rank=args.rank, seed=i))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, profiles = [], []

    def engine_row(batch: int, used: int, target: float):
        inputs, ids = _decode_inputs(llm, batch, ctx, gen)
        base = bench_ms(lambda: llm.model.execute(Phase.DECODE, inputs, float_logits=False))
        slots = llm.model.lora.slots_for([names[i % used] for i in range(batch)])
        lora_in = {**inputs, "lora_indices": torch.tensor(slots, dtype=torch.int32, device="cuda")}
        lora = bench_ms(lambda: llm.model.execute(Phase.DECODE, lora_in, float_logits=False))
        if args.profile and batch > 1:
            from profile_decode import kernel_table
            for label, step_inputs in (("base", inputs), ("LoRA", lora_in)):
                table, total = kernel_table(llm, step_inputs)
                profiles.append(f"eager step, batch {batch}, {label}: kernels sum to {total:.0f} µs\n"
                                + "\n".join(table))
        for sid in ids:
            llm.blocks.free(sid)
        extra_ms = _lora_bytes(llm, used) / (copy * 1e9) * 1e3
        rows.append((f"engine decode step, batch {batch}, {used} adapter(s)", base, lora, target,
                     f"+{_lora_bytes(llm, used) / 1e6:.0f} MB = {extra_ms * 1e3:.0f} µs at copy rate"))

    engine_row(1, 1, 1.10)
    engine_row(args.batch, args.adapters, 1.25)
    if not args.skip_generate:
        params = gd.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        g = torch.Generator().manual_seed(1)
        for batch, used, target in ((1, 1, 1.10), (args.batch, args.adapters, 1.25)):
            prompts = [torch.randint(0, 1000, (64,), generator=g).tolist() for _ in range(batch)]
            loras = [names[i % used] for i in range(batch)]
            _generate_s(llm, prompts, params, None)            # warm: engines, graphs, buckets
            _generate_s(llm, prompts, params, loras)
            base = min(_generate_s(llm, prompts, params, None) for _ in range(2)) * 1e3
            lora = min(_generate_s(llm, prompts, params, loras) for _ in range(2)) * 1e3
            rows.append((f"LLM.generate {batch} x {args.new_tokens} tokens, {used} adapter(s)", base, lora, target, ""))
    print(f"{args.shape}, rank {args.rank}, all linear targets, context {ctx} — {device_line()}; copy {copy:.0f} GB/s")
    ops = [n.op for n in llm.model.engine(Phase.DECODE, lora=True).net.nodes]
    base_nodes = len(llm.model.engine(Phase.DECODE).net.nodes)
    counts = {op: ops.count(op) for op in ("matmul_lora", "matmul_silu_mul_lora", "matmul_add_lora", "lora_apply",
                                           "silu_mul")}
    print(f"LoRA decode graph: {len(ops)} nodes (base {base_nodes}); "
          + ", ".join(f"{op} x{c}" for op, c in counts.items()))
    print(f"{'case':<48} {'base ms':>10} {'LoRA ms':>10} {'ratio':>7} {'target':>7}  note")
    for name, base, lora, target, note in rows:
        ok = "ok" if lora / base <= target else "MISS"
        print(f"{name:<48} {base:>10.3f} {lora:>10.3f} {lora / base:>6.3f}x {target:>6.2f}x  {ok} {note}")
    for table in profiles:
        print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
