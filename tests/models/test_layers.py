"""Layers against plain-torch / transformers references, through a built engine."""

import pytest
import torch

from graphdsl import Dim, Module, Network, Tensor
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError
from graphdsl.layers import (GemmaRMSNorm, LayerNorm, MoE, QKVLayout, QKVParallelLinear, RMSNorm, RopeScaling,
                             RopeType, RotaryEmbedding, Scoring, TopkMethod, VocabParallelEmbedding, alibi_slopes,
                             checkpoint_layout)
from graphdsl.models import build_config

ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary_tables_match_transformers(case):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    params = dict(ROPE_CASES[case], rope_theta=50000.0)
    hf_cfg = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=256, rope_parameters=params)
    ours = build_config(hf_cfg.to_dict())
    rotary = RotaryEmbedding(ours.head_dim, ours.rope_theta, ours.max_position_embeddings, ours.rope_scaling)
    hf_rotary = LlamaRotaryEmbedding(hf_cfg)
    # positions beyond max_position_embeddings exercise dynamic NTK's rescaling
    positions = torch.tensor([0, 1, 7, 63, 64, 100, 255] + ([400] if case == "dynamic" else []))
    x = torch.zeros(1, len(positions), ours.head_dim)
    hf_cos, hf_sin = hf_rotary(x, positions[None])
    cos, sin = rotary.cos_sin(positions)
    half = ours.head_dim // 2
    torch.testing.assert_close(cos, hf_cos[0, :, :half], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[0, :, :half], rtol=1e-5, atol=1e-5)
    if case != "default":
        assert not torch.allclose(rotary.inv_freq()[0], RotaryEmbedding(ours.head_dim, 50000.0).inv_freq()[0]) \
            or case == "dynamic"


def test_rotary_tables_are_computed_once_per_device(monkeypatch):
    """A decode step must not copy a fresh CPU frequency table to the GPU (that copy waits for the
    previous step): the table is made once per device, and per effective length for dynamic NTK."""
    rotary = RotaryEmbedding(64, 10000.0, 32, RopeScaling(rope_type=RopeType.LLAMA3, factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=16))
    calls = []
    real = rotary.inv_freq
    monkeypatch.setattr(rotary, "inv_freq", lambda *a: calls.append(a) or real(*a))
    first = rotary.cos_sin(torch.tensor([3, 9]))
    for p in (5, 70, 2):
        cos, sin = rotary.cos_sin(torch.tensor([p]))
        want = torch.tensor([float(p)])[:, None] * real()[0][None, :]
        torch.testing.assert_close(cos, want.cos())
    assert len(calls) == 1 and first[0].shape == (2, 32)
    dynamic = RotaryEmbedding(64, 10000.0, 32, RopeScaling(rope_type=RopeType.DYNAMIC, factor=2.0))
    for n in (5, 20, 40, 40, 70):
        dynamic.cos_sin(torch.arange(n))
    assert sorted(k[1] for k in dynamic._inv_cache) == [32, 40, 70]     # lengths <= 32 share one table
    assert rotary.captures_tables and not dynamic.captures_tables            # dynamic NTK reads positions.max()


def test_rope_scaling_validation():
    with pytest.raises(GraphDSLError, match="llama3 scaling needs original_max_position_embeddings"):
        RopeScaling(rope_type=RopeType.LLAMA3, factor=8.0)
    with pytest.raises(GraphDSLError, match="rope_type must be a RopeType"):
        RopeScaling(rope_type="llama3")
    with pytest.raises(GraphDSLError, match="rotary_dim must be even"):
        RotaryEmbedding(64, rotary_dim=63)


def _run(build, feed):
    n = Dim("n")
    with Network("t") as net:
        outs = build(n)
        for i, o in enumerate(outs if isinstance(outs, tuple) else (outs,)):
            net.mark_output(o, f"out{i}")
    engine = net.build_engine()
    res = engine.forward(feed)
    return [res[f"out{i}"] for i in range(len(res))]


def test_rope_layouts_rotate_pairs():
    rotary_neox = RotaryEmbedding(8, layout=F.RopeLayout.NEOX)
    rotary_gptj = RotaryEmbedding(8, layout=F.RopeLayout.GPTJ)
    pos = torch.arange(5)
    cos, sin = rotary_neox.cos_sin(pos)
    q, k = torch.randn(5, 2, 8), torch.randn(5, 1, 8)

    def rotate_ref(x, pairs):
        out = x.clone()
        for i, (a, b) in enumerate(pairs):
            c, s = cos[:, i, None], sin[:, i, None]
            out[..., a] = x[..., a] * c - x[..., b] * s
            out[..., b] = x[..., b] * c + x[..., a] * s
        return out

    for rotary, pairs in ((rotary_neox, [(i, i + 4) for i in range(4)]), (rotary_gptj, [(2 * i, 2 * i + 1) for i in range(4)])):
        got = _run(lambda n: rotary(Tensor("q", (n, 2, 8), torch.float32), Tensor("k", (n, 1, 8), torch.float32),
                                    Tensor("cos", (n, 4), torch.float32), Tensor("sin", (n, 4), torch.float32)),
                   {"q": q, "k": k, "cos": cos, "sin": sin})
        torch.testing.assert_close(got[0], rotate_ref(q, pairs))
        torch.testing.assert_close(got[1], rotate_ref(k, pairs))


def test_rmsnorm_with_residual_returns_new_residual():
    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.rand(16) + 0.5
    norm = RMSNorm(16, eps=1e-5, dtype=torch.float32)
    y, new_r = _run(lambda n: norm(Tensor("x", (n, 16), torch.float32), Tensor("r", (n, 16), torch.float32)),
                    {"x": x, "r": r, "weight": w})
    s = x + r
    torch.testing.assert_close(new_r, s)
    torch.testing.assert_close(y, w * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_gemma_rmsnorm_matches_transformers_in_bfloat16():
    """``(1 + w)`` multiplied in float32 before the cast back: bit-equal to transformers' Gemma norm,
    also with the residual add (in the stream's dtype) in front."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
    torch.manual_seed(0)
    x, r = torch.randn(5, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    w = (torch.randn(32) * 0.1).bfloat16()
    hf = HFGemmaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(w)
    norm = GemmaRMSNorm(32, eps=1e-6, dtype=torch.bfloat16)
    y, new_r = _run(lambda n: norm(Tensor("x", (n, 32), torch.bfloat16), Tensor("r", (n, 32), torch.bfloat16)),
                    {"x": x, "r": r, "weight": w})
    assert y.dtype == torch.bfloat16 and torch.equal(new_r, x + r)
    with torch.no_grad():
        assert torch.equal(y, hf(x + r))


@pytest.mark.parametrize("heads", [1, 4, 12, 16, 112])
def test_alibi_slopes_match_bloom(heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    torch.testing.assert_close(torch.tensor(alibi_slopes(heads), dtype=torch.float32),
                               _get_alibi_slopes(heads, torch.device("cpu")), rtol=1e-6, atol=0)


def test_per_head_qkv_checkpoint_layout():
    """Bloom's query_key_value rows [head, (q | k | v), head_dim] land in the [q | k | v] parameter."""
    h, d, n = 3, 2, 5
    qkv = QKVParallelLinear(n, d, h, h, bias=True, dtype=torch.float32, layout=QKVLayout.PER_HEAD)
    table = checkpoint_layout(qkv, "attn.qkv_proj")
    assert set(table) == {"attn.qkv_proj.weight", "attn.qkv_proj.bias"}
    w = torch.arange(3 * h * d * n, dtype=torch.float32).reshape(3 * h * d, n)
    slot = table["attn.qkv_proj.weight"]
    got = slot.place(w).reshape(3 * h * d, n)
    per_head = w.reshape(h, 3, d, n)
    for j in range(3):          # q, k, v blocks of the parameter
        torch.testing.assert_close(got[j * h * d:(j + 1) * h * d], per_head[:, j].reshape(h * d, n))
    with pytest.raises(GraphDSLError, match="per-head q/k/v layout needs num_kv_heads == num_heads"):
        QKVParallelLinear(n, d, 4, 2, layout=QKVLayout.PER_HEAD)


def test_embedding_scale():
    emb = VocabParallelEmbedding(10, 4, torch.float32, scale=3.0)
    w = torch.randn(10, 4)
    (y,) = _run(lambda n: emb(Tensor("ids", (n,), torch.int64)), {"ids": torch.tensor([2, 7]), "weight": w})
    torch.testing.assert_close(y, w[[2, 7]] * 3.0)


def test_layernorm_matches_torch():
    x, w, b = torch.randn(3, 16), torch.randn(16), torch.randn(16)
    ln = LayerNorm(16, eps=1e-5, dtype=torch.float32)
    (y,) = _run(lambda n: ln(Tensor("x", (n, 16), torch.float32)), {"x": x, "weight": w, "bias": b})
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,), w, b, 1e-5))


def test_qkv_linear_splits_heads_and_declares_checkpoint_slots():
    qkv = QKVParallelLinear(16, head_dim=4, num_heads=4, num_kv_heads=2, bias=True, dtype=torch.float32)
    x, w, b = torch.randn(3, 16), torch.randn(32, 16), torch.randn(32)
    q, k, v = _run(lambda n: qkv(Tensor("x", (n, 16), torch.float32)), {"x": x, "weight": w, "bias": b})
    full = x @ w.T + b
    torch.testing.assert_close(q, full[:, :16].reshape(3, 4, 4))
    torch.testing.assert_close(v, full[:, 24:].reshape(3, 2, 4))
    table = checkpoint_layout(qkv, "attn.qkv_proj")
    assert table["attn.k_proj.bias"].index == (slice(16, 24),) and table["attn.v_proj.weight"].shape == (8, 16)
    with pytest.raises(GraphDSLError, match="num_heads \\(4\\) must be a multiple of num_kv_heads \\(3\\)"):
        QKVParallelLinear(16, 4, 4, 3)


def _moe_reference(x, gate_w, gate_up, down, top_k, scoring, renormalize, shared=None):
    logits = (x @ gate_w.T).float()
    scores = logits.softmax(-1) if scoring is Scoring.SOFTMAX else logits.sigmoid()
    w, idx = scores.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = idx[t, j]
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    if shared is not None:
        sgu, sdown, sgate = shared
        g, u = (x @ sgu.T).chunk(2, -1)
        out += torch.sigmoid(x @ sgate.T) * ((torch.nn.functional.silu(g) * u) @ sdown.T)
    return out


@pytest.mark.parametrize("scoring,renormalize,shared", [(Scoring.SOFTMAX, False, True), (Scoring.SOFTMAX, True, False),
                                                        (Scoring.SIGMOID, True, False), (Scoring.SIGMOID, False, True)])
def test_moe_matches_per_token_reference(scoring, renormalize, shared):
    torch.manual_seed(0)
    h, e, i, si, k = 16, 5, 8, 12, 2
    moe = MoE(h, e, k, i, scoring=scoring, renormalize=renormalize, shared_intermediate_size=si if shared else None,
              shared_expert_gate=shared, dtype=torch.float32)
    x = torch.randn(6, h)
    w = {"gate.weight": torch.randn(e, h), "experts.gate_up_proj": torch.randn(e, 2 * i, h) * 0.3,
         "experts.down_proj": torch.randn(e, h, i) * 0.3}
    if shared:
        w.update({"shared_expert.gate_up_proj.weight": torch.randn(2 * si, h) * 0.3,
                  "shared_expert.down_proj.weight": torch.randn(h, si) * 0.3,
                  "shared_expert_gate.weight": torch.randn(1, h)})
    (y,) = _run(lambda n: moe(Tensor("x", (n, h), torch.float32)), {"x": x, **w})
    ref = _moe_reference(x, w["gate.weight"], w["experts.gate_up_proj"], w["experts.down_proj"], k, scoring,
                         renormalize, (w["shared_expert.gate_up_proj.weight"], w["shared_expert.down_proj.weight"],
                                       w["shared_expert_gate.weight"]) if shared else None)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


class _Routing(Module):
    """Records ``moe.routing_weights`` under the module path ``moe``."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe.routing_weights(x)


@pytest.mark.parametrize("version,method", [("v2", "greedy"), ("v2", "group_limited_greedy"), ("v3", "noaux_tc")])
def test_deepseek_routing_matches_transformers(version, method):
    """The dense routing matrix equals transformers' DeepSeek routers' (top-k ids and weights):
    group-limited greedy, V3's bias-chosen groups and experts with renormalised sigmoid weights, and
    the routed scaling factor."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    torch.manual_seed(1)
    h, e, k = 16, 16, 3
    common = dict(hidden_size=h, num_attention_heads=4, n_routed_experts=e, num_experts_per_tok=k, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5)
    if version == "v2":
        hf = DeepseekV2TopkRouter(transformers.DeepseekV2Config(**common, topk_method=method))
        scoring, renormalize = Scoring.SOFTMAX, False
    else:
        hf = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**common, norm_topk_prob=True))
        hf.e_score_correction_bias.normal_(0, 0.3)
        scoring, renormalize = Scoring.SIGMOID, True
    hf.weight.data.normal_(0, 1)
    x = torch.randn(40, h)
    moe = MoE(h, e, k, 8, scoring=scoring, renormalize=renormalize, topk_method=TopkMethod(method), num_groups=4,
              topk_groups=2, routed_scaling_factor=2.5, router_float32=True, dtype=torch.float32)
    feed = {"x": x, "moe.gate.weight": hf.weight.data}
    if version == "v3":
        feed["moe.gate.e_score_correction_bias"] = hf.e_score_correction_bias
    (got,) = _run(lambda n: _Routing(moe)(Tensor("x", (n, h), torch.float32)), feed)
    with torch.no_grad():
        logits, weights, ids = hf(x)
    want = torch.zeros(40, e).scatter(1, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    scores = logits.softmax(-1) if version == "v2" else logits.sigmoid() + hf.e_score_correction_bias
    greedy = torch.zeros(40, e).scatter(1, torch.topk(scores, k).indices, 1.0)
    assert (method == "greedy") == torch.equal(greedy, (want > 0).float())   # the groups change some choices


def test_moe_argument_errors():
    with pytest.raises(GraphDSLError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        MoE(8, 4, 5, 8)
    with pytest.raises(GraphDSLError, match="scoring must be a Scoring"):
        MoE(8, 4, 2, 8, scoring="softmax")
    with pytest.raises(GraphDSLError, match="topk_method must be a TopkMethod, one of"):
        MoE(8, 4, 2, 8, topk_method="noaux_tc")
    with pytest.raises(GraphDSLError, match="at least top_k=3 experts in the chosen groups, got num_groups=4, "
                                            "topk_groups=1"):
        MoE(8, 8, 3, 8, topk_method=TopkMethod.GROUP_LIMITED_GREEDY, num_groups=4, topk_groups=1)
    table = checkpoint_layout(MoE(8, 4, 2, 4, topk_method=TopkMethod.NOAUX_TC, num_groups=2), "mlp")
    assert table["mlp.gate.e_score_correction_bias"].shape == (4,)
    table = checkpoint_layout(MoE(8, 3, 2, 4), "mlp")
    assert table["mlp.experts.2.up_proj.weight"].index == (2, slice(4, 8))
    assert table["mlp.experts.0.down_proj.weight"].shape == (8, 4)
