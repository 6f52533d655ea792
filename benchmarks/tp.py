"""Tensor-parallel batch-1 decode: Llama-3-8B shape at TP1 and TP2, and a Llama-3-70B shape (80 layers,
random weights) at TP2, in ms/token and as % of each rank's roofline.

    python3 benchmarks/tp.py [--tp 2] [--shapes llama-3-8b llama-3-70b] [--tokens 128]
                             [--allreduce symm_mem nccl carry] [--eager] [--dtype float32]
                             [--quantization int4]

Decode time per token = (time to generate ``16 + tokens`` tokens − time to generate 16) / tokens,
through ``LLM.generate`` (the serving loop, step announcement to the workers included), median of
three; beside it the engine step alone (the step executor back to back at the mean context). TP>1
rows replay decode CUDA graphs that capture the collectives (the default), once per all-reduce path
of ``--allreduce`` (``GRAPHDSL_ALLREDUCE``: the one-shot kernel over peer-mapped buffers or NCCL;
``carry``: the one-shot path with ``GRAPHDSL_TP_CARRY=1``, the all-reduce and norm carried by the
decode GEMVs around them, runtime/backends/tp_carry.py);
``--eager`` adds rows with decode graphs off (``GRAPHDSL_TP_CUDA_GRAPHS=0``). Each TP>1 row of a
shape measured at TP1 too says whether its greedy tokens (the ``16 + tokens`` of the timed call)
equal TP1's, and if not, how close TP1's top two candidates were where they part (random weights
give near-flat logits; in bf16 the ranks' partial sums round differently from TP1's whole ones;
``--dtype float32`` shrinks that rounding; ``--quantization`` quantizes every row's weights online,
each rank its own slices). Roofline per rank = (the rank's weights as stored, except its
embedding shard + its KV cache at the mean context) ÷ measured device-to-device copy bandwidth;
collectives are not in the roofline, so the % shows what they and the step announcement cost. Each
configuration runs in a fresh process (``--timeout`` bounds it) and its row prints as soon as it is
measured. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
set here before torch loads).
"""
from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, device_line, generate_s  # noqa: E402
from llm import SHAPES, _decode_inputs  # noqa: E402
from quant import stored_bytes  # noqa: E402

SHAPES = dict(SHAPES)
SHAPES["llama-3-70b"] = dict(SHAPES["llama-3-8b"], hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=8)
PROMPT = 32
WARM = 16


def rank_bytes(llm, context: int) -> int:
    """Bytes rank 0 reads per decode token: its parameters as stored (a quantized one's codes and
    scales) but the embedding shard, and its KV cache at ``context`` tokens."""
    weights = stored_bytes(llm)
    kv = llm.kv_cache.key_caches[0]
    kv_per_token = 2 * len(llm.kv_cache.key_caches) * kv.shape[2] * kv.shape[3] * kv.element_size()
    return weights + context * kv_per_token


def decode_ms(llm, tokens: int) -> tuple[float, list[int], list[float]]:
    """Median ms/token over three differences; the greedy tokens of a ``WARM + tokens`` call, and at
    each token how far apart (in logprob) its top two candidates were."""
    import graphdsl as gd
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(PROMPT)]
    generate_s(llm, prompt, WARM + tokens)           # build + capture
    times = [(generate_s(llm, prompt, WARM + tokens) - generate_s(llm, prompt, WARM)) * 1e3 / tokens
             for _ in range(3)]
    sp = gd.SamplingParams(max_tokens=WARM + tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    gaps = []
    for position in out.logprobs:
        top = sorted((lp.logprob for lp in position.values()), reverse=True)
        gaps.append(top[0] - top[1])
    return statistics.median(times), list(out.token_ids), gaps


def engine_step_ms(llm, context: int, steps: int = 50) -> float:
    """ms of one batch-1 decode step run through the step executor alone, back to back (no
    scheduler, sampler or detokenizer; at TP>1 the step's announcement to the workers included)."""
    inputs, ids = _decode_inputs(llm, 1, context, torch.Generator(device=llm.device).manual_seed(0))
    try:
        for _ in range(5):
            llm._executor.execute("decode", inputs, 1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm._executor.execute("decode", inputs, 1)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / steps
    finally:
        for sid in ids:
            llm.blocks.free(sid)


def measure(shape: str, tp: int, tokens: int, graphs: bool, allreduce: str, copy: float, dtype: str = "bfloat16",
            quantization: str | None = None, report=print) -> None:
    """One configuration, in this process (``--row``): build, time, ``report`` the row (a ``ROW``
    line of JSON), close."""
    import graphdsl as gd
    os.environ.update({"GRAPHDSL_TP_CUDA_GRAPHS": "1" if graphs else "0",     # read here and inherited
                       "GRAPHDSL_ALLREDUCE": "symm_mem" if allreduce == "carry" else allreduce,   # by the workers
                       "GRAPHDSL_TP_CARRY": "1" if allreduce == "carry" else "0"})
    llm = gd.LLM.from_config(SHAPES[shape], device="cuda", dtype=dtype, seed=0, quantization=quantization,
                             max_model_len=PROMPT + WARM + tokens + 16, max_num_seqs=1, tensor_parallel_size=tp)
    try:
        ms, ids, gaps = decode_ms(llm, tokens)
        context = PROMPT + WARM + tokens // 2
        step = engine_step_ms(llm, context)
        roof_ms = rank_bytes(llm, context) / (copy * 1e9) * 1e3
        report("ROW " + json.dumps({"shape": shape, "tp": tp, "graphs": graphs or tp == 1,
                                    "allreduce": allreduce if tp > 1 else "—", "ms": ms, "step_ms": step,
                                    "roof_ms": roof_ms, "ids": ids, "gaps": gaps}), flush=True)
    finally:
        llm.close()


def measure_in_child(shape: str, tp: int, tokens: int, graphs: bool, allreduce: str, copy: float, dtype: str,
                     quantization: str | None, timeout_s: float) -> dict:
    """:func:`measure` in a fresh process, so that no configuration inherits another's process group
    or symmetric-memory buffers (a second tensor-parallel ``LLM`` in one process is not what this
    times), and a configuration that fails or hangs still leaves the others' rows."""
    import signal
    import subprocess
    row = json.dumps([shape, tp, tokens, graphs, allreduce, copy, dtype, quantization])
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--row", row], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=timeout_s)
        why = f"exit code {child.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)        # its worker ranks too
        out, _ = child.communicate()
        why = f"no result within {timeout_s:.0f}s"
    except BaseException:                           # interrupted: leave no ranks behind
        os.killpg(child.pid, signal.SIGKILL)
        raise
    lines = [ln for ln in out.splitlines() if ln.startswith("ROW ")]
    if lines:                                       # measured, even if the teardown after it failed
        return json.loads(lines[-1][4:])
    print(f"{shape} TP{tp} graphs={graphs} {allreduce}: failed ({why})", file=sys.stderr, flush=True)
    return {"shape": shape, "tp": tp, "graphs": graphs, "allreduce": allreduce, "ms": float("nan"),
            "step_ms": float("nan"), "roof_ms": float("nan"), "ids": [], "gaps": []}


def _same_tokens(ids: list[int], ref: list[int] | None, ref_gaps: list[float] | None = None) -> str:
    """Whether greedy ``ids`` equal ``ref`` (TP1's); if not, from which token, and how far apart TP1's
    top two candidates were there (a near tie that rounding may flip, or a real difference)."""
    if ref is None or not ids:
        return "—"
    if ids == ref:
        return f"yes ({len(ref)})"
    first = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    why = ""
    if ref_gaps and first < len(ref_gaps):
        smaller = sum(g < ref_gaps[first] for g in ref_gaps) / len(ref_gaps)
        why = (f" (TP1's top two {ref_gaps[first]:.4f} apart there; {100 * smaller:.0f}% of TP1's tokens"
               " had them closer)")
    return f"no: from token {first} of {len(ref)}{why}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["llama-3-8b", "llama-3-70b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--allreduce", nargs="+", default=["symm_mem", "nccl"], choices=["symm_mem", "nccl", "carry"],
                    help="all-reduce paths to time at TP>1 (GRAPHDSL_ALLREDUCE; carry: GRAPHDSL_TP_CARRY=1 too)")
    ap.add_argument("--eager", action="store_true", help="also time TP>1 with decode CUDA graphs off")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the model's dtype (float32 shows whether TP's tokens part from TP1's by rounding alone)")
    ap.add_argument("--quantization", choices=["int4", "int8", "fp8"],
                    help="quantize the weights online (LLM's quantization=; each rank its own slices)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one configuration may take")
    ap.add_argument("--row", help=argparse.SUPPRESS)     # internal: one configuration, in a child process
    args = ap.parse_args(argv)
    if args.row is not None:
        measure(*json.loads(args.row))
        return 0
    if torch.cuda.device_count() < args.tp:
        print(f"tp.py needs {args.tp} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    copy = copy_bandwidth_gbs()
    what = args.dtype + (f", weights {args.quantization}" if args.quantization else "")
    print(f"# tensor-parallel batch-1 decode, {what} — {device_line()}; copy {copy:.0f} GB/s per GPU",
          flush=True)
    print("| shape | TP | decode CUDA graphs | all-reduce | ms/token | engine step ms | roofline ms/token (per rank) "
          "| % of roofline | vs TP1 | greedy tokens equal to TP1 |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for shape in args.shapes:
        runs = [(1, True, "nccl")] if shape == "llama-3-8b" else []
        runs += [(args.tp, True, ar) for ar in args.allreduce]
        runs += [(args.tp, False, ar) for ar in args.allreduce[:1]] if args.eager else []
        base = None
        for tp, graphs, ar in runs:
            t0 = time.perf_counter()
            r = measure_in_child(shape, tp, args.tokens, graphs, ar, copy, args.dtype, args.quantization, args.timeout)
            print(f"{shape} TP{tp} graphs={graphs} {ar}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            if tp == 1:
                base = r
            rel = f"{r['ms'] / base['ms']:.2f}x" if base is not None else "—"
            same = _same_tokens(r["ids"], base["ids"] if base is not None and tp > 1 else None,
                                base["gaps"] if base is not None else None)
            print(f"| {shape} | {tp} | {'yes' if r['graphs'] else 'no'} | {r['allreduce']} | {r['ms']:.3f} | "
                  f"{r['step_ms']:.3f} | {r['roof_ms']:.3f} | {100 * r['roof_ms'] / r['ms']:.1f}% | {rel} | {same} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
