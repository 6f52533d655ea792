"""engine.profile() on a GPU (``pytest -m gpu``): a real model geometry with random weights
(benchmarks/llm.py's shapes), one prefill and one batch-1 decode step; the per-kernel times must
sum to within 5% of the step timed without per-kernel events, and every launch must have a row.

    GRAPHDSL_TEST_PROFILE_SHAPE=llama-3-8b python3 -m pytest -m gpu tests/gpu/test_profile_gpu.py -s

(default shape: llama-3.2-1b). ``-s`` prints both tables.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import graphdsl as gd
from graphdsl.entrypoints.profile import profile_model, write_profile
from graphdsl.layers import Phase

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from llm import SHAPES  # noqa: E402

SHAPE = os.environ.get("GRAPHDSL_TEST_PROFILE_SHAPE", "llama-3.2-1b")


@pytest.fixture(scope="module")
def reports():
    llm = gd.LLM.from_config(SHAPES[SHAPE], device="cuda", dtype="bfloat16", seed=0, max_model_len=1024,
                             max_num_seqs=1, cuda_graphs=False)
    for k, v in zip(llm.kv_cache.key_caches, llm.kv_cache.value_caches):
        k.normal_()
        v.normal_()
    reps = profile_model(llm, prompt_tokens=512, context=512, iters=10)
    reps["_launches"] = {p: llm.model.engine(Phase(p)).num_launches for p in ("prefill", "decode")}
    return reps


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_kernel_times_sum_to_the_step(reports, phase, tmp_path):
    rep = reports[phase]
    print(f"\n{SHAPE} {phase}\n{rep.table()}")
    assert len(rep.rows) == reports["_launches"][phase]
    assert abs(rep.kernel_ms - rep.step_ms) <= 0.05 * rep.step_ms, \
        f"kernels sum {rep.kernel_ms:.3f} ms vs step {rep.step_ms:.3f} ms"
    assert all(r.ceiling < 1.2 for r in rep.rows), "a kernel beats the measured ceiling: the work count is wrong"
    write_profile({phase: rep}, tmp_path)
    assert (tmp_path / "profile.html").stat().st_size > 0
