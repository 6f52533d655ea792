"""Triton kernels compiled ahead on worker processes (runtime/precompile.py) on a GPU (run with
``pytest -m gpu``): two fresh processes with empty Triton, engine and generated-kernel caches run
the same greedy generation with logprobs, one with ``GRAPHDSL_COMPILE_WORKERS=4`` and one with the
kernels compiled one by one in the steps. The first must have compiled kernels ahead with none
left over — the decode graph's prologue and epilogue kernels in one round with its forward's — and
both must give the same tokens and logprobs bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json
import graphdsl as gd
from graphdsl.runtime import precompile
cfg = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
llm = gd.LLM.from_config(cfg, device="cuda", dtype="bfloat16", seed=0, max_model_len=256, max_num_seqs=4)
outs = llm.generate([[5, 9, 13, 200, 31] * 7, [3] * 40], gd.SamplingParams(max_tokens=12, temperature=0, logprobs=2,
                                                                           ignore_eos=True))
print("RESULT " + json.dumps({
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [[sorted((k, v.logprob) for k, v in step.items()) for step in o.outputs[0].logprobs] for o in outs],
    "reports": [dict(label=r.label, deferred=r.deferred, kernels=r.kernels, on_disk=r.on_disk, compiled=r.compiled, failed=r.failed,
                     workers=r.workers, dry_error=r.dry_error) for r in precompile.history]}))
"""


def _run(tmp_path: Path, workers: int) -> dict:
    d = tmp_path / f"w{workers}"
    env = dict(os.environ, TRITON_CACHE_DIR=str(d / "triton"), GRAPHDSL_CACHE_DIR=str(d / "engines"),
               GRAPHDSL_KERNEL_CACHE=str(d / "kernels"), GRAPHDSL_COMPILE_WORKERS=str(workers))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_kernels_compiled_ahead_change_no_bit_of_the_output(tmp_path):
    ahead = _run(tmp_path, 4)
    plain = _run(tmp_path, 0)
    reports = ahead["reports"]
    print(json.dumps(reports, indent=1))
    assert reports, "no engine forward compiled ahead"
    assert sum(r["compiled"] for r in reports) >= 5
    assert all(r["failed"] == [] and r["dry_error"] is None for r in reports)
    # the decode graph's step compiled its prologue's and epilogue's kernels ahead with the forward's
    graph = [r for r in reports if r["label"].startswith("graph step")]
    assert graph and all(k in graph[0]["kernels"] for k in ("_step_inputs_kernel", "_gumbel_argmax_kernel"))
    assert len(graph[0]["kernels"]) > 2
    assert plain["reports"] == []
    assert ahead["tokens"] == plain["tokens"]
    assert ahead["logprobs"] == plain["logprobs"]
