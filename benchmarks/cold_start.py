"""Cold start of an engine's first steps with Triton's kernels compiled ahead on worker processes
(``runtime/precompile.py``) against one by one in the step, each in a fresh process with empty
Triton, engine and generated-kernel caches (a fresh machine), then warm (the caches that run left).

    python benchmarks/cold_start.py --shape llama-3-8b [--workers 16] [--rounds 1]
    python benchmarks/cold_start.py --shape llama-3.2-1b --warmup 32

Per run: seconds to build the decode engine and run its first step (batch 1, context 512), the
same for the prefill engine (64 tokens), what ``precompile`` did, and a digest of the first decode
step's logits: compiling ahead must not change a bit of them. Prints a markdown table.

``--warmup N``: instead, a server's start-up — ``LLM(..., max_num_seqs=N, max_model_len=1024)`` and
``LLM.warmup()`` (what ``graphdsl serve`` runs on CUDA before it listens: every prefill token bucket
and decode batch bucket), then a greedy generation whose tokens are digested; the table also gives
the memory torch holds after the warm-up (``torch.cuda.memory_reserved``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm import SHAPES  # noqa: E402

CONTEXT = 512
CHILD_TAG = "COLD_START_JSON "


def _child(shape: str) -> int:
    """One fresh process: build, first steps, report as JSON on stdout."""
    import torch

    import graphdsl as gd
    from graphdsl.layers import Phase
    from graphdsl.runtime import precompile
    from llm import BLOCK, _decode_inputs, _make_llm, _prefill_inputs, random_kv, triton_cache_entries

    before = triton_cache_entries()
    llm = _make_llm(gd, SHAPES[shape], "cuda", "bfloat16", CONTEXT + 64, 1, CONTEXT // BLOCK + 8)
    torch.manual_seed(0)                    # the same cache in every run: the digests must agree
    random_kv(llm)
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for phase in (Phase.DECODE, Phase.PREFILL):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.model.engine(phase)
        out[f"{phase.value}_build"] = time.perf_counter() - t0
        inputs, ids = (_decode_inputs(llm, 1, CONTEXT, gen) if phase is Phase.DECODE
                       else _prefill_inputs(llm, 64, gen))
        t0 = time.perf_counter()
        logits = llm.model.execute(phase, inputs)
        torch.cuda.synchronize()
        out[f"{phase.value}_first_step"] = time.perf_counter() - t0
        if isinstance(logits, dict):
            logits = next(iter(logits.values()))
        out[f"{phase.value}_digest"] = hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()[:16]
        for sid in ids:
            llm.blocks.free(sid)
    out["triton_new"] = triton_cache_entries() - before
    out["ahead"] = [str(r) for r in precompile.history]
    print(CHILD_TAG + json.dumps(out), flush=True)
    return 0


WARMUP_MAX_MODEL_LEN = 1024


def _warmup_child(shape: str, seqs: int) -> int:
    """One fresh process: a server's start-up (``LLM.warmup``), then a greedy generation."""
    import graphdsl as gd
    from graphdsl.runtime import precompile
    from llm import triton_cache_entries

    before = triton_cache_entries()
    t0 = time.perf_counter()
    llm = gd.LLM.from_config(SHAPES[shape], device="cuda", dtype="bfloat16", seed=0,
                             max_model_len=WARMUP_MAX_MODEL_LEN, max_num_seqs=seqs)
    load = time.perf_counter() - t0
    rep = llm.warmup(stream=None)
    import torch
    reserved = torch.cuda.memory_reserved() / 2**30          # what the warm-up left torch holding
    outs = llm.generate([[(i * 7919 + j * 104729) % 1000 for j in range(40)] for i in range(4)],
                        gd.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    rounds = precompile.history
    out = {"load": load, "warmup": rep.seconds, "stages": rep.stages, "triton_new": triton_cache_entries() - before,
           "rounds": len(rounds), "ahead_compiled": sum(r.compiled for r in rounds),
           "ahead_seconds": sum(r.seconds for r in rounds), "ahead_failed": sum(len(r.failed) for r in rounds),
           "reserved_gib": reserved, "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}
    print(CHILD_TAG + json.dumps(out), flush=True)
    return 0


def warmup_table(shape: str, seqs: int, rows: list[tuple[str, str, dict]]) -> tuple[str, bool]:
    """The markdown report of ``--warmup`` runs and whether every run's tokens agreed."""
    out = [f"{shape}: a server's start-up, seconds (fresh process; LLM.warmup at max_num_seqs {seqs}, "
           f"max_model_len {WARMUP_MAX_MODEL_LEN}, then a greedy generation)", "",
           "| compiles | caches | load | warm-up | slowest stage | Triton cache entries written | rounds ahead "
           "| compiled ahead (s in rounds) | reserved GiB | tokens digest |",
           "|---|---|---:|---:|---|---:|---:|---|---:|---|"]
    for mode, cache, r in rows:
        label, secs = max(r["stages"], key=lambda st: st[1]) if r["stages"] else ("-", 0.0)
        failed = f", {r['ahead_failed']} left to the step" if r["ahead_failed"] else ""
        out.append(f"| {mode} | {cache} | {r['load']:.1f} | {r['warmup']:.1f} | {label} {secs:.1f} | "
                   f"{r['triton_new']} | {r['rounds']} | {r['ahead_compiled']} ({r['ahead_seconds']:.1f}){failed} | "
                   f"{r['reserved_gib']:.2f} | {r['digest']} |")
    same = len({r["digest"] for _, _, r in rows}) == 1
    out.append(f"\ngenerated tokens identical across runs: {'yes' if same else 'NO'}")
    return "\n".join(out), same


def _run(shape: str, env: dict, warmup: int | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--shape", shape, "--child"]
    if warmup:
        cmd += ["--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_TAG):
            return json.loads(line.removeprefix(CHILD_TAG))
    raise RuntimeError(f"child failed (exit {proc.returncode}): {proc.stderr[-1500:]}")


def table(shape: str, rows: list[tuple[str, str, dict]]) -> tuple[str, bool]:
    """The markdown report of ``rows`` (``(mode, caches, child result)``) and whether every run's
    decode logits digest agreed."""
    out = [f"{shape}: build + first step, seconds (fresh process; decode batch 1 at context {CONTEXT}, "
           "prefill 64 tokens)", "",
           "| compiles | caches | decode | prefill | total | Triton cache entries written | decode logits digest |",
           "|---|---|---:|---:|---:|---:|---|"]
    for mode, cache, res in rows:
        dec = res["decode_build"] + res["decode_first_step"]
        pre = res["prefill_build"] + res["prefill_first_step"]
        out.append(f"| {mode} | {cache} | {dec:.2f} | {pre:.2f} | {dec + pre:.2f} | {res['triton_new']} | "
                   f"{res['decode_digest']} |")
    out.append("")
    out += [f"- {mode}, {cache}: {line}" for mode, cache, res in rows for line in res["ahead"]]
    same = len({res["decode_digest"] for _, _, res in rows}) == 1
    out.append(f"\ndecode logits identical across runs: {'yes' if same else 'NO'}")
    return "\n".join(out), same


def main(argv=None) -> int:
    from common import at_least
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES), help="model geometry (random weights)")
    ap.add_argument("--workers", type=at_least(2), default=16, help="GRAPHDSL_COMPILE_WORKERS of the 'ahead' runs")
    ap.add_argument("--rounds", type=at_least(1), default=1, help="fresh-cache runs of each mode")
    ap.add_argument("--warmup", type=at_least(1), default=None, metavar="N",
                    help="time a server's start-up instead: LLM.warmup() at max_num_seqs N")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _warmup_child(args.shape, args.warmup) if args.warmup else _child(args.shape)
    import torch
    if not torch.cuda.is_available():
        print("cold_start.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from common import device_line
    print(device_line())
    rows = []
    for _ in range(args.rounds):
        for mode, workers in (("one by one", 0), ("ahead", args.workers)):
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ, TRITON_CACHE_DIR=f"{d}/triton", GRAPHDSL_CACHE_DIR=f"{d}/engines",
                           GRAPHDSL_KERNEL_CACHE=f"{d}/kernels", GRAPHDSL_COMPILE_WORKERS=str(workers))
                for cache in ("cold", "warm"):
                    res = _run(args.shape, env, args.warmup)
                    rows.append((mode, cache, res))
                    print(f"[{time.strftime('%H:%M:%S')}] {mode} {cache}: {json.dumps(res)}", file=sys.stderr,
                          flush=True)
    report, same = warmup_table(args.shape, args.warmup, rows) if args.warmup else table(args.shape, rows)
    print()
    print(report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
