"""GGUF blocks kept quantized on the GPU: a tiny Llama GGUF (Q8_0 / Q4_0 / Q4_1 matrices) loaded with
``quantization="gguf"`` on CUDA scores and greedy-decodes (CUDA graphs, the GGUF GEMV) like the same
file dequantized on load (the blocks stored block-major, as a CUDA bind does); and the benchmark's Q4_K_M mix (Q4_K / Q6_K, and qkv_proj keeping both)
decodes (GEMV) consistently with its prefill (dequantize + cuBLAS).

    python3 -m pytest -m gpu tests/gpu/test_gguf_quant_gpu.py
"""
import pytest
import torch

import graphdsl as gd

pytestmark = pytest.mark.gpu

IDS = [3, 17, 42, 90, 5, 64, 7, 11]


def test_kept_gguf_blocks_on_cuda(tmp_path):
    from gguf import GGMLQuantizationType as Q

    from tests.helpers.gguf_files import hf_model_to_gguf
    from tests.models.hf_tiny import make_checkpoint
    from tests.models.test_gguf import _tok_meta
    hf = make_checkpoint("llama", tmp_path / "hf", vocab_size=96)
    path = tmp_path / "q.gguf"
    hf_model_to_gguf(path, hf, "llama", tokenizer_meta=_tok_meta(96),
                     quant={r"self_attn": Q.Q8_0, r"gate_proj|up_proj": Q.Q4_1, r"down_proj": Q.Q4_0})
    kw = dict(device="cuda", dtype="float32", max_model_len=64, max_num_seqs=2)
    llm = gd.LLM(str(path), quantization="gguf", **kw)
    kept = [p.quant.name for _, p in llm.model.named_parameters() if p.quant is not None]
    assert len(kept) == 8 and all(k.endswith("-kb") for k in kept)     # a CUDA bind stores them block-major
    dense = gd.LLM(str(path), **kw)
    ref = dense.score(IDS)
    torch.testing.assert_close(llm.score(IDS), ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)
    params = gd.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([IDS, IDS[:3]], params)]
    assert got == [o.outputs[0].token_ids for o in dense.generate([IDS, IDS[:3]], params)]


def test_q4_k_m_mix_decode_agrees_with_prefill():
    """The benchmark's Q4_K_M mix on CUDA: greedy tokens of the decode GEMV (one row) are the argmax
    of a prefill over 20+ tokens (dequantize + cuBLAS) of the same sequence."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import quant
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128,
               max_position_embeddings=256, rms_norm_eps=1e-5)
    with quant._GGUFMix():
        llm = gd.LLM.from_config(cfg, device="cuda", dtype="float32", seed=0, max_model_len=64, max_num_seqs=1,
                                 quantization="gguf-q4_k_m", init_std=0.1)
    kinds = {p.quant.name for _, p in llm.model.named_parameters() if p.quant is not None}
    assert kinds == {"gguf-q4_k-kb", "gguf-q6_k-kb", "gguf-q4_k.384+q6_k.128-kb"}     # q|k Q4_K, v Q6_K; block-major
    prompt = [(7 * i + 3) % 128 for i in range(20)]
    toks = llm.generate([prompt], gd.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    logits = llm.score(prompt + toks[:-1])
    assert torch.isfinite(logits).all()
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == toks


def test_q4_k_m_v_rows_beside_give_the_same_tokens(monkeypatch):
    """Under PDL and CUDA graphs, the mixed ``qkv_proj``'s Q6_K ``v`` rows launched beside its Q4_K
    ``q``/``k`` rows on the tensor cores (``triton_backend._PARTS_BESIDE``) give the greedy tokens and
    logprobs of the parts one after another, bit for bit, batch 1 and batch 2."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import quant
    from graphdsl.runtime.backends import triton_backend
    from graphdsl.runtime.kernels import gguf_linear
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128,
               max_position_embeddings=256, rms_norm_eps=1e-5)
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 256)      # q|k's 384 rows on the tensor cores, v's 128 not
    calls = []
    real = gguf_linear.gguf_gemv
    monkeypatch.setattr(gguf_linear, "gguf_gemv", lambda *a, **kw: calls.append(kw.get("beside", False)) or real(*a, **kw))
    params = gd.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [[(5 * i + 1) % 128 for i in range(9)], [3, 17, 42]]
    got = {}
    for side in (False, True):
        monkeypatch.setattr(triton_backend, "_PARTS_BESIDE", side)
        with quant._GGUFMix():
            llm = gd.LLM.from_config(cfg, device="cuda", dtype="bfloat16", seed=0, max_model_len=64, max_num_seqs=2,
                                     quantization="gguf-q4_k_m", init_std=0.1)
        calls.clear()
        got[side] = [[(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                               o.outputs[0].token_ids)])
                      for o in llm.generate(ps, params)] for ps in ([prompts[0]], prompts)]
        assert any(calls) == side
    assert got[True] == got[False]
