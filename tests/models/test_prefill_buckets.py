"""Prefill steps padded to shape buckets (runtime/serving/prefill_pad.py) give the tokens and
logprobs of unpadded steps: dense attention, latent attention (MLA + sparse experts) and sliding
windows, with chunked prompts and prompt logprobs; and they reuse the engine's shape plans."""
import pytest
import torch

import graphdsl as gd
from graphdsl.layers import Phase
from tests.models.hf_tiny import make_checkpoint

PROMPTS = [[1, 5, 9, 33, 2, 77, 100, 3, 8, 9, 10], [4, 5, 6], list(range(2, 40))]
OVERRIDES = {"deepseek_v2": dict(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                 topk_group=1)}


def _run(path, monkeypatch, flag: str, **llm_kw):
    monkeypatch.setenv("GRAPHDSL_PREFILL_BUCKETS", flag)
    llm = gd.LLM(path, device="cpu", dtype="float32", max_model_len=64, **llm_kw)
    sp = gd.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    return llm, llm.generate(PROMPTS, sp)


@pytest.mark.parametrize("family", ["llama", "deepseek_v2", "gemma2"])
def test_padded_prefill_equals_unpadded(family, tmp_path, monkeypatch):
    make_checkpoint(family, tmp_path, **OVERRIDES.get(family, {}))
    _, plain = _run(tmp_path, monkeypatch, "0")
    llm, padded = _run(tmp_path, monkeypatch, "1", max_num_batched_tokens=16)   # chunked prompts too
    for a, b in zip(plain, padded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[k].logprob - pb[k].logprob) < 1e-4 for k in pa)
        assert [p and set(p) for p in a.prompt_logprobs] == [p and set(p) for p in b.prompt_logprobs]
    signatures = {tuple(k[1]) for k in llm.model.engine(Phase.PREFILL)._plans}
    token_counts = {dict((n, s) for n, s, _ in sig)["input_ids"][0] for sig in signatures}
    assert all(n % 16 == 0 or n in (18, 20, 22, 24, 26, 28, 30) for n in token_counts), token_counts


def test_padded_prefill_casts_only_the_projected_rows(tmp_path, monkeypatch):
    """A padded prefill projects pow2(max_num_seqs) rows at least; only the real ones become float32
    logits (at 256 rows of a 128256-token vocabulary the cast alone wrote 131 MB a step)."""
    from graphdsl.models.executor import ModelExecutor
    make_checkpoint("llama", tmp_path)
    seen = []
    real = ModelExecutor.execute

    def spy(self, phase, inputs, rows=None):
        out = real(self, phase, inputs, rows)
        if phase == "prefill":
            seen.append((inputs["lm_head_indices"].shape[0], rows, tuple(out.shape), out.dtype))
        return out
    monkeypatch.setattr(ModelExecutor, "execute", spy)
    monkeypatch.setenv("GRAPHDSL_PREFILL_BUCKETS", "1")
    llm = gd.LLM(tmp_path, device="cpu", dtype="float32", max_model_len=64, max_num_seqs=16)
    llm.generate(PROMPTS[:2], gd.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert seen and all(heads == 16 and rows == 2 and shape[0] == 2 and dtype == torch.float32
                        for heads, rows, shape, dtype in seen), seen
