"""GPU soak (run with ``pytest -m gpu``): 500 random requests through ``LLM.generate`` on a tiny
random Llama on CUDA, with a KV pool small enough to force preemption. Every request must finish,
and its tokens (greedy, and seeded top-k/top-p sampling on the device) must equal the same request
run alone — with the serving loop's overlap on and off."""
import sys

import pytest
import torch

from tests.helpers.soak import random_requests, soak, tiny_llm

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_soak_500_requests_with_preemption(overlap):
    llm = tiny_llm("cuda", num_kv_blocks=16, max_num_seqs=32, max_num_batched_tokens=128)
    llm.overlap = overlap
    stats = soak(llm, random_requests(500, seed=7), log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"soak (overlap={overlap}): {stats}", file=sys.stderr)
    assert stats["preemptions"] > 0
