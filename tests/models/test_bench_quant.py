"""benchmarks/quant.py: the roofline's weight bytes are what a decode step reads, the lm_head once
whether or not it is tied to the embedding table, a quantized weight as its stored companions."""
import math
import sys

import pytest

import graphdsl as gd
from tests.helpers import benchmarks
from tests.helpers.soak import TINY_LLAMA


@pytest.fixture(scope="module")
def quant():
    sys.path.insert(0, str(benchmarks.ROOT))          # quant.py imports llm.py beside it
    try:
        return benchmarks.load("quant")
    finally:
        sys.path.remove(str(benchmarks.ROOT))


def _llm(tie: bool, quantization=None):
    return gd.LLM.from_config(dict(TINY_LLAMA, tie_word_embeddings=tie), device="cpu", dtype="bfloat16", seed=0,
                              max_model_len=64, max_num_seqs=1, quantization=quantization)


def _layer_bytes(llm) -> int:
    bound = llm.model._bound
    return sum(bound[n].numel() * bound[n].element_size() for n, _ in llm.model.named_parameters()
               if n not in ("model.embed_tokens.weight", "lm_head.weight"))


def test_a_tied_lm_head_counts_once(quant):
    tied, untied = _llm(True), _llm(False)
    head = TINY_LLAMA["vocab_size"] * TINY_LLAMA["hidden_size"] * 2      # bfloat16
    assert quant.stored_bytes(untied) == _layer_bytes(untied) + head
    assert quant.stored_bytes(tied) == quant.stored_bytes(untied)


def test_quantized_weights_count_their_stored_companions(quant):
    bf16, int8 = _llm(True), _llm(True, "int8")
    proj = sum(math.prod(p.shape) for n, p in bf16.model.named_parameters() if n.endswith("proj.weight"))
    rows = sum(p.shape[0] for n, p in bf16.model.named_parameters() if n.endswith("proj.weight"))
    # int8 per channel: a byte a code and one bfloat16 scale a row, in place of two bytes a weight;
    # the embedding and the (tied) lm_head stay bfloat16
    assert quant.stored_bytes(bf16) - quant.stored_bytes(int8) == proj - 2 * rows


def test_expert_stacks_count_the_share_one_token_reads(quant):
    """A one-token step reads ``top_k`` of the experts: the roofline counts that share of each
    stack, quantized or not (a Mixtral-like tiny model, 2 of 8 experts)."""
    from tests.models.hf_tiny import make_config
    cfg = make_config("mixtral").to_dict()
    llm = {q: gd.LLM.from_config(cfg, device="cpu", dtype="bfloat16", seed=0, max_model_len=64, max_num_seqs=1,
                                 quantization=q) for q in (None, "int8")}
    bound = llm[None].model._bound
    stacks = {n: p for n, p in llm[None].model.named_parameters() if ".experts." in n}
    assert len(stacks) == 4
    full = sum(bound[n].numel() * bound[n].element_size() for n in bound
               if n in dict(llm[None].model.named_parameters()) and n != "model.embed_tokens.weight")
    stack_bytes = sum(math.prod(p.shape) * 2 for p in stacks.values())
    assert quant.stored_bytes(llm[None]) == full - stack_bytes + stack_bytes // 4
    # int8: per expert a byte a code and a bfloat16 scale a row, a quarter of it read
    codes = sum(math.prod(p.shape) + 2 * p.shape[0] * p.shape[1] for p in stacks.values())
    q = llm["int8"].model
    dense = sum(llm["int8"].model._bound[c.name].numel() * llm["int8"].model._bound[c.name].element_size()
                for n, p in q.named_parameters() if n in stacks for c in p.companions())
    assert dense == codes
    assert quant.stored_bytes(llm["int8"]) - codes // 4 == \
        quant.stored_bytes(llm[None]) - stack_bytes // 4 - _linear_savings(llm[None])


def _linear_savings(llm) -> int:
    """Bytes int8 per channel saves on the linears (not the stacks): a byte a weight less one scale a row."""
    ps = [p for n, p in llm.model.named_parameters() if n.endswith("proj.weight") and ".experts." not in n]
    return sum(math.prod(p.shape) - 2 * p.shape[0] for p in ps)


def test_gguf_expert_stacks_count_their_file_blocks(quant):
    """Expert stacks in GGUF blocks (online ``gguf-q8_0``: 34 bytes a block of 32) count their
    experts' block bytes, the one-token share of them (2 of 8 experts), like the linears' blocks."""
    from tests.models.hf_tiny import make_config
    cfg = make_config("mixtral").to_dict()
    llm = {q: gd.LLM.from_config(cfg, device="cpu", dtype="bfloat16", seed=0, max_model_len=64, max_num_seqs=1,
                                 quantization=q) for q in (None, "gguf-q8_0")}
    kept = {n: p for n, p in llm["gguf-q8_0"].model.named_parameters() if p.quant is not None}
    assert sum(".experts." in n for n in kept) == 4
    change = 0
    for n, p in kept.items():
        experts, (rows, k) = (p.shape[0] if len(p.shape) == 3 else 1), p.shape[-2:]
        share = 4 if ".experts." in n else 1                   # a quarter of a stack's bytes is read
        change += experts * rows * (k // 32 * 34 - 2 * k) // share
    assert quant.stored_bytes(llm["gguf-q8_0"]) == quant.stored_bytes(llm[None]) + change


def test_q4_k_m_mix_falls_back_where_rows_hold_no_super_block(quant):
    """The benchmark's Q4_K_M mix gives a matrix whose inputs are no multiple of 256 llama.cpp's
    fallback type (Q4_K -> Q5_0, Q6_K -> Q8_0): a Mixtral of hidden 256 and experts 96 wide keeps
    gate/up in Q4_K and its experts' down in Q5_0 or Q8_0, by layer."""
    from tests.models.hf_tiny import make_config
    cfg = dict(make_config("mixtral").to_dict(), hidden_size=256, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
    with quant._GGUFMix():
        llm = gd.LLM.from_config(cfg, device="cpu", dtype="float32", seed=0, max_model_len=32, max_num_seqs=1,
                                 quantization="gguf-q4_k_m")
    schemes = {n: p.quant.name for n, p in llm.model.named_parameters() if ".experts." in n}
    layers = cfg["num_hidden_layers"]
    assert schemes == {f"model.layers.{i}.mlp.experts.{s}": q for i in range(layers) for s, q in (
        ("gate_up_proj", "gguf-q4_k"),
        ("down_proj", "gguf-q8_0" if quant._use_more_bits(i, layers) else "gguf-q5_0"))}
    assert quant.with_fallbacks({"a": "Q6_K", "b": "Q4_K", "c": "Q4_K"}, {"a": 1408, "b": 1408, "c": 2048}) == \
        {"a": "Q8_0", "b": "Q5_0", "c": "Q4_K"}
    assert llm.score([1, 2, 3]).isfinite().all()


def _four_layer_llama(quant, mix: str):
    """``(llm, {parameter: scheme name})`` of a 4-layer Llama (hidden 256) marked with the benchmark's
    ``mix`` (random weights rounded onto its blocks)."""
    from tests.models.hf_tiny import make_config
    cfg = dict(make_config("llama").to_dict(), hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, num_hidden_layers=4)
    with quant._GGUFMix():
        llm = gd.LLM.from_config(cfg, device="cpu", dtype="float32", seed=0, max_model_len=32, max_num_seqs=1,
                                 quantization=mix)
    return llm, {n: p.quant.name for n, p in llm.model.named_parameters() if getattr(p, "quant", None) is not None}


def test_q5_k_m_mix_is_the_q4_k_m_rule_with_q5_k(quant):
    """``gguf-q5_k_m`` marks a Llama as llama.cpp's Q5_K_M: every attention and MLP matrix Q5_K but
    ``attn_v`` and ``ffn_down`` Q6_K in the layers of ``use_more_bits`` (of 4 layers: 2 and 3; a fused
    qkv then holds both types), and the model scores."""
    llm, schemes = _four_layer_llama(quant, "gguf-q5_k_m")
    assert [quant._use_more_bits(i, 4) for i in range(4)] == [False, False, True, True]
    for i in range(4):
        more = quant._use_more_bits(i, 4)
        assert schemes[f"model.layers.{i}.self_attn.qkv_proj.weight"] == (
            "gguf-q5_k.384+q6_k.128" if more else "gguf-q5_k")
        assert schemes[f"model.layers.{i}.mlp.down_proj.weight"] == ("gguf-q6_k" if more else "gguf-q5_k")
        assert schemes[f"model.layers.{i}.self_attn.o_proj.weight"] == "gguf-q5_k"
        assert schemes[f"model.layers.{i}.mlp.gate_up_proj.weight"] == "gguf-q5_k"
    assert llm.score([1, 2, 3]).isfinite().all()


def test_q8_0_mix_is_every_matrix_q8_0(quant):
    """``gguf-q8_0`` marks a Llama as a llama.cpp Q8_0 file: every attention and MLP matrix Q8_0, in the
    layers of ``use_more_bits`` too (one GEMV for qkv), and the model scores."""
    llm, schemes = _four_layer_llama(quant, "gguf-q8_0")
    assert set(schemes.values()) == {"gguf-q8_0"}
    assert {n.split(".")[-2] for n in schemes} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert len(schemes) == 4 * 4
    assert llm.score([1, 2, 3]).isfinite().all()


def test_every_ab_flag_switches_a_knob_that_exists(quant):
    """Each A/B flag's runs are in ``_AB_RUNS``, and each run's switch is a module attribute of
    ``gguf_linear`` (or ``triton_backend.``) whose value differs from the one the run sets, so no flag
    names a knob that an edit renamed or a run that changes nothing."""
    names = [n for runs, _, _ in quant._AB_FLAGS.values() for n in runs]
    assert sorted(names) == sorted(quant._AB_RUNS)
    for attr, value, _ in quant._AB_RUNS.values():
        mod, name = quant.switch_target(attr)
        assert getattr(mod, name) != value, attr
