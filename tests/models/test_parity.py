"""HF parity: tiny random checkpoints saved by transformers must score and greedy-decode alike.

For every family: float32 logits of every position within 1e-4 x max|logit| of transformers',
and 32 greedy tokens from ``llm.generate`` (two prompts batched: packed prefill, batched decode
over the paged cache) equal to ``model.generate`` on each prompt alone.
"""
import json

import pytest
import torch

import graphdsl as gd
from graphdsl.models import check_model
from tests.models.hf_tiny import hf_greedy, hf_logits, make_checkpoint

PROMPTS = [[1, 5, 9, 33, 2, 77, 100, 3, 8, 9, 10, 11, 12, 13, 40, 41, 42, 150, 7], [4, 5, 6]]
FAMILIES = {
    "llama-sharded": ("llama", {"max_shard_size": "100KB"}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral-sliding-window": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe-renormalised-with-dense-layer": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "mixtral-sliding-window": ("mixtral", {"sliding_window": 8}),
    "gemma": ("gemma", {}),
    "gemma2-sliding-window-and-soft-caps": ("gemma2", {}),
    "bloom-alibi": ("bloom", {}),
    "deepseek_v2-mla-grouped-routing-yarn": ("deepseek_v2", {}),
    "deepseek_v2-q-lora": ("deepseek_v2", {"q_lora_rank": 24, "topk_method": "greedy", "n_group": 1,
                                           "topk_group": 1}),
    "deepseek_v3-noaux-tc": ("deepseek_v3", {}),
}


def check_parity(llm, hf_model, prompts=PROMPTS, n_tokens=32):
    for ids in prompts:
        ours, ref = llm.score(ids), hf_logits(hf_model, ids)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"max |logit diff| {err} vs max |logit| {ref.abs().max()}"
    outs = llm.generate(prompts, gd.SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, [o.outputs[0] for o in outs]):
        assert out.finish_reason == "length" and len(out.token_ids) == n_tokens
        assert out.token_ids == hf_greedy(hf_model, ids, n_tokens)


@pytest.mark.parametrize("case", list(FAMILIES))
def test_family_parity(case, tmp_path):
    family, kw = FAMILIES[case]
    save_kw = {k: kw.pop(k) for k in list(kw) if k == "max_shard_size"}
    hf_model = make_checkpoint(family, tmp_path, **save_kw, **kw)
    if save_kw:
        assert (tmp_path / "model.safetensors.index.json").exists()
    assert check_model(tmp_path).ok, str(check_model(tmp_path))
    llm = gd.LLM(tmp_path, device="cpu", max_model_len=96)
    check_parity(llm, hf_model)


def _to_transformers4_layout(directory, rope_scaling):
    """Rewrite a transformers-5 config.json the way published (transformers 4) checkpoints look."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params["rope_theta"]
    cfg["rope_scaling"] = rope_scaling
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_transformers4_config_layout_with_rope_scaling(scaling, tmp_path):
    params = dict(scaling, rope_theta=5000.0)
    params["rope_type"] = params.pop("type", params.get("rope_type"))
    hf_model = make_checkpoint("llama", tmp_path, rope_parameters=params)
    _to_transformers4_layout(tmp_path, scaling | {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rope_theta"] == 5000.0
    llm = gd.LLM(tmp_path, device="cpu", max_model_len=96)
    assert llm.config.rope_theta == 5000.0 and llm.config.rope_scaling.factor == scaling["factor"]
    check_parity(llm, hf_model, prompts=PROMPTS[:1], n_tokens=16)
