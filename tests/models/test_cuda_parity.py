"""The parity suite on CUDA (default backend there: generated Triton kernels + cuBLAS).

Marked ``gpu``: run on the device machine with ``pytest -m gpu tests/models``.
"""
import pytest
import torch

import graphdsl as gd
from graphdsl.layers import Phase
from tests.models.hf_tiny import hf_greedy, hf_logits, make_checkpoint
from tests.models.test_parity import PROMPTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma",
                                    "gemma2", "bloom", "deepseek_v2", "deepseek_v3"])
def test_cuda_float32_parity(family, tmp_path):
    hf_model = make_checkpoint(family, tmp_path)
    llm = gd.LLM(tmp_path, device="cuda", dtype="float32", max_model_len=96)
    for ids in PROMPTS:
        ours, ref = llm.score(ids).cpu(), hf_logits(hf_model, ids)
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    outs = llm.generate(PROMPTS, gd.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, ids, 32) for ids in PROMPTS]
    assert llm.model.engine(Phase.DECODE).device.type == "cuda"


def test_cuda_bfloat16_runs_close(tmp_path):
    hf_model = make_checkpoint("llama", tmp_path)
    llm = gd.LLM(tmp_path, device="cuda", dtype="bfloat16", max_model_len=96)
    ours, ref = llm.score(PROMPTS[0]).cpu(), hf_logits(hf_model, PROMPTS[0])
    assert ours.dtype == torch.float32 and (ours - ref).abs().max() <= 0.05 * ref.abs().max()
