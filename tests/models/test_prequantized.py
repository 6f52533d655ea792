"""Pre-quantized HF checkpoints (compressed-tensors, AutoAWQ, GPTQ) load with ``gd.LLM(path)`` alone:
tiny random llama / qwen2 checkpoints written in each on-disk layout (tests/models/quant_checkpoints.py)
score like transformers running the dequantized weights — transformers' own compressed-tensors
loading where it can read the checkpoint — and every unsupported scheme or layout mismatch is an
error naming the tensor and the scheme."""
import json
import os

import pytest
import torch

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from tests.models.hf_tiny import hf_logits, make_checkpoint
from tests.models.quant_checkpoints import base_model, mixtral_names, write_awq, write_compressed_tensors, write_gptq

IDS = [3, 17, 42, 99, 5, 120, 64, 7]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """One tiny random model per family (shared by the cases; each writes its own directory)."""
    return {f: base_model(f, tmp_path_factory.mktemp(f)) for f in ("llama", "qwen2")}


def _int(bits, sym=True, group=None):
    return dict(num_bits=bits, type="int", symmetric=sym, strategy="group" if group else "channel", group_size=group)


FP8_TOKEN = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)

# (id, family, writer, kwargs, the schemes the linears take, transformers loads it itself)
CASES = [
    ("ct-pack-int4-g32", "llama", "ct", dict(fmt="pack-quantized", weights=_int(4, group=32)), {"int4-g32"}, True),
    ("ct-pack-int4-g128-zp", "qwen2", "ct", dict(fmt="pack-quantized", weights=_int(4, sym=False, group=128)),
     {"int4-g128-zp"}, False),     # transformers 5.24 shapes the packed zero points wrongly and refuses
    ("ct-pack-int4-channel-zp", "llama", "ct", dict(fmt="pack-quantized", weights=_int(4, sym=False)),
     {"int4-g128-zp"}, False),
    ("ct-pack-int8", "qwen2", "ct", dict(fmt="pack-quantized", weights=_int(8)), {"int8-channel"}, True),
    ("ct-naive-int4-g64-zp", "llama", "ct", dict(fmt="naive-quantized", weights=_int(4, sym=False, group=64)),
     {"int4-g64-zp"}, False),
    ("ct-int-quantized-int8", "llama", "ct", dict(fmt="int-quantized", weights=_int(8)), {"int8-channel"}, True),
    ("ct-fp8-tensor", "llama", "ct", dict(fmt="float-quantized", weights=dict(num_bits=8, type="float",
                                                                             strategy="tensor")), {"fp8-channel"}, True),
    ("ct-fp8-channel-dyn", "qwen2", "ct", dict(fmt="float-quantized", weights=dict(num_bits=8, type="float",
                                                                                   strategy="channel"),
                                              input_activations=FP8_TOKEN), {"fp8-channel-dyn"}, True),
    ("awq-g64", "llama", "awq", dict(group=64), {"int4-g64-zp"}, False),
    ("awq-g128", "qwen2", "awq", dict(group=128), {"int4-g128-zp"}, False),
    ("gptq-sym-g32", "llama", "gptq", dict(group=32, sym=True), {"int4-g32"}, False),
    ("gptq-asym-g128", "qwen2", "gptq", dict(group=128, sym=False), {"int4-g128-zp"}, False),
    ("gptq-v2-asym-channel", "llama", "gptq", dict(group=-1, sym=False, v2=True), {"int4-g128-zp"}, False),
    ("ct-pack-int4-g32-actorder-weight", "llama", "ct",
     dict(fmt="pack-quantized", weights=dict(_int(4, group=32), actorder="weight")), {"int4-g32"}, True),
    # act-order: down_proj's input order is folded into gate/up's rows at bind, so it takes the plain scheme
    ("ct-pack-int4-g32-actorder-group", "llama", "ct", dict(fmt="pack-quantized", weights=_int(4, group=32),
                                                             act_order=True), {"int4-g32-act", "int4-g32"}, False),
    ("ct-naive-int4-g64-zp-actorder-group", "qwen2", "ct",
     dict(fmt="naive-quantized", weights=_int(4, sym=False, group=64), act_order=True),
     {"int4-g64-zp-act", "int4-g64-zp"}, False),
    ("gptq-act-order-sym-g32", "llama", "gptq", dict(group=32, sym=True, act_order=True),
     {"int4-g32-act", "int4-g32"}, False),
    ("gptq-act-order-asym-g64", "qwen2", "gptq", dict(group=64, sym=False, act_order=True),
     {"int4-g64-zp-act", "int4-g64-zp"}, False),
]
WRITERS = {"ct": write_compressed_tensors, "awq": write_awq, "gptq": write_gptq}


def _write(bases, tmp_path, family, writer, kw):
    return WRITERS[writer](bases[family], tmp_path / "q", **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prequantized_checkpoint_scores_like_transformers(bases, tmp_path, case):
    _, family, writer, kw, schemes, hf_loads = case
    if writer == "ct":
        pytest.importorskip("compressed_tensors")
    ref_model = _write(bases, tmp_path, family, writer, kw)
    llm = gd.LLM(tmp_path / "q", device="cpu", max_model_len=64, max_num_seqs=1)
    quantized = [p for _, p in llm.model.named_parameters() if p.quant is not None]
    assert len(quantized) == 2 * 4 and {p.quant.name for p in quantized} == schemes
    assert not any(p.quant is not None for n, p in llm.model.named_parameters() if n.startswith("lm_head"))
    ours = llm.score(IDS)
    if hf_loads:        # transformers' own compressed-tensors loading (decompresses; fp8 -dyn quantizes tokens)
        import transformers as tf
        ref_model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ref = hf_logits(ref_model, IDS)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    full = hf_logits(bases[family], IDS)
    assert not torch.allclose(ours, full, atol=1e-3), "the checkpoint's quantization changed nothing"


MOE_CASES = [("int4-g32", dict(fmt="pack-quantized", weights=_int(4, group=32))),
             ("int4-g32-zp", dict(fmt="pack-quantized", weights=_int(4, sym=False, group=32))),
             ("int8-channel", dict(fmt="pack-quantized", weights=_int(8))),
             ("fp8-channel", dict(fmt="float-quantized", weights=dict(num_bits=8, type="float", strategy="channel")))]


@pytest.mark.parametrize("scheme,kw", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_compressed_tensors_moe_keeps_its_expert_stacks_quantized(tmp_path, scheme, kw):
    """A compressed-tensors Qwen3-MoE (every expert's gate, up and down quantized, as checkpoints
    such as Qwen3-30B-A3B w4a16 store them; the router ignored): each stack loads in the stored
    scheme (``quant_moe_experts``) and the model scores like transformers running the dequantized
    weights."""
    pytest.importorskip("compressed_tensors")
    base = base_model("qwen3_moe", tmp_path / "base")
    ref = write_compressed_tensors(base, tmp_path / "q", ignore=("lm_head", "re:.*mlp.gate$"), **kw)
    llm = _load(tmp_path / "q")
    stacks = {n: p.quant.name if p.quant is not None else None for n, p in llm.model.named_parameters()
              if ".experts." in f".{n}"}
    assert stacks == {"model.layers.0.mlp.experts.gate_up_proj": scheme, "model.layers.0.mlp.experts.down_proj": scheme}
    assert llm.model.get_submodule("model.layers.0.mlp.gate").weight.quant is None
    assert "quant_moe_experts" in {n.op for n in llm.model.engine(gd.layers.Phase.PREFILL).net.nodes}
    torch.testing.assert_close(llm.score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("scheme,kw", [MOE_CASES[0], MOE_CASES[2]], ids=[MOE_CASES[0][0], MOE_CASES[2][0]])
def test_compressed_tensors_deepseek_dequantizes_the_absorbed_kv_b_proj(tmp_path, scheme, kw):
    """A compressed-tensors DeepSeek-V2 with every linear quantized, MLA's ``kv_b_proj`` included
    (what llm-compressor's default ``Linear`` targets store): ``kv_b_proj``'s weight is absorbed into
    the attention's matmuls, so its stored tensors are dequantized as they load; the other linears,
    the shared experts and the expert stacks keep the stored scheme; the logits equal transformers'
    on the dequantized weights. (Quantized, ``kv_b_proj`` failed to bind: the attention missed its
    plain weight.)"""
    pytest.importorskip("compressed_tensors")
    base = make_checkpoint("deepseek_v2", tmp_path / "base", hidden_size=128, intermediate_size=256)   # MLA: kv = q heads
    ref = write_compressed_tensors(base, tmp_path / "q", ignore=("lm_head", "re:.*mlp.gate$"), **kw)
    llm = _load(tmp_path / "q")
    schemes = {n: p.quant.name if p.quant is not None else None for n, p in llm.model.named_parameters()}
    assert schemes["model.layers.0.self_attn.kv_b_proj.weight"] is None
    assert schemes["model.layers.0.self_attn.o_proj.weight"] == scheme
    assert schemes["model.layers.1.mlp.shared_expert.down_proj.weight"] == scheme
    assert schemes["model.layers.1.mlp.experts.gate_up_proj"] == scheme
    torch.testing.assert_close(llm.score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)


def test_config_patterns_match_the_checkpoint_s_own_module_names(tmp_path):
    """llm-compressor's Mixtral checkpoints ignore the router as ``re:.*block_sparse_moe.gate$``,
    the name on disk; graphdsl calls it ``mlp.gate``. The pattern is matched against the
    checkpoint's name, so the router loads in full precision and the experts quantized."""
    pytest.importorskip("compressed_tensors")
    base = base_model("mixtral", tmp_path / "base")
    ref = write_compressed_tensors(base, tmp_path / "q", fmt="pack-quantized", weights=_int(4, group=32),
                                   ignore=("lm_head", "re:.*block_sparse_moe.gate$"), rename=mixtral_names)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight_packed" in _tensor_names(tmp_path / "q")
    llm = _load(tmp_path / "q")
    assert llm.model.get_submodule("model.layers.0.mlp.gate").weight.quant is None
    assert llm.model.get_submodule("model.layers.0.mlp.experts").down_proj.quant.name == "int4-g32"
    torch.testing.assert_close(llm.score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)


def _tensor_names(path) -> set:
    from graphdsl.runtime.loaders.safetensors import tensor_names
    return set(tensor_names(path))


def test_int8_experts_load_onto_the_host(tmp_path):
    """A compressed-tensors int8 Qwen3-MoE with its experts moved to the host (CPUExperts): the
    codes are placed there (the companions follow their stack's device) and it scores like
    transformers on the dequantized weights."""
    pytest.importorskip("compressed_tensors")
    ref = write_compressed_tensors(base_model("qwen3_moe", tmp_path / "base"), tmp_path / "q",
                                   ignore=("lm_head", "re:.*mlp.gate$"), fmt="pack-quantized", weights=_int(8))
    rules = [{"match": {"name": r"^model\.layers\.\d+\.mlp\.experts$"},
              "replace": {"class": "graphdsl.models.cpu_experts.CPUExperts", "kwargs": {"generate_device": "cpu"}}}]
    llm = gd.LLM(tmp_path / "q", device="cpu", max_model_len=64, max_num_seqs=1, optimize_rules=rules)
    experts = llm.model.get_submodule("model.layers.0.mlp.experts")
    assert type(experts).__name__ == "CPUExperts" and experts.down_proj.quant.name == "int8-channel"
    assert llm.model.parameter_devices()["model.layers.0.mlp.experts.down_proj_scale"] == "cpu"
    torch.testing.assert_close(llm.score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)


def test_quantized_experts_the_host_cannot_run_are_refused(tmp_path):
    """CPUExperts runs int8 and int4 stacks (torch's CPU kernels), not fp8: a checkpoint storing
    them so is an error naming the stack, not a model that silently reads codes as weights."""
    pytest.importorskip("compressed_tensors")
    write_compressed_tensors(base_model("qwen3_moe", tmp_path / "base"), tmp_path / "q",
                             ignore=("lm_head", "re:.*mlp.gate$"), fmt="float-quantized",
                             weights=dict(num_bits=8, type="float", strategy="channel"))
    rules = [{"match": {"name": r"^model\.layers\.\d+\.mlp\.experts$"},
              "replace": {"class": "graphdsl.models.cpu_experts.CPUExperts", "kwargs": {"generate_device": "cpu"}}}]
    with pytest.raises(GraphDSLError, match=r"stores the experts of 'model.layers.0.mlp.experts.gate_up_proj' "
                                            r"quantized \(fp8-channel\), which CPUExperts does not run \(it runs "
                                            r"int8-channel and int4"):
        gd.LLM(tmp_path / "q", device="cpu", max_model_len=64, max_num_seqs=1, optimize_rules=rules)


def _patch_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for k, v in changes.items():
        if v is None:
            config["quantization_config"].pop(k, None)
        else:
            config["quantization_config"][k] = v
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _load(path):
    return gd.LLM(path, device="cpu", max_model_len=64, max_num_seqs=1)


def _edit_tensors(path, edit) -> dict:
    """Rewrite ``path``'s ``model.safetensors`` with ``edit(tensors)`` applied (it changes the dict in
    place); returns the edited tensors."""
    from safetensors.torch import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return tensors


def test_gptq_act_order_keeps_one_input_order_per_fused_linear(bases, tmp_path):
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True, act_order=True)
    params = dict(_load(tmp_path / "q").model.named_parameters())
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.quant.name == "int4-g32-act" and [c.name.rpartition(".")[2] for c in qkv.companions()] == \
        ["weight_packed", "weight_scale", "weight_perm"]


def _gathers(llm) -> int:
    from graphdsl.layers import Phase
    return sum(n.op == "gather" and n.attrs.get("dim") == -1 for n in llm.model.engine(Phase.DECODE).net.nodes)


def test_gptq_act_order_down_projection_order_folds_into_gate_up(bases, tmp_path, monkeypatch):
    """An act-order down_proj reads ``act(gate) * up`` in its input order: bind stores gate/up's rows
    in that order instead (``layers.quantize.fold_input_order``), so down_proj takes the plain scheme
    and its gather is gone (3 a layer, not 4); the logits are the same bits as without the fold."""
    from graphdsl.layers import quantize
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=False, act_order=True)
    llm = _load(tmp_path / "q")
    params = dict(llm.model.named_parameters())
    down = params["model.layers.0.mlp.down_proj.weight"]
    assert down.quant.name == "int4-g32-zp" and params["model.layers.0.mlp.gate_up_proj.weight"].quant.name == \
        "int4-g32-zp-act"
    assert "model.layers.0.mlp.down_proj.weight_perm" not in llm.model._bound
    assert _gathers(llm) == 3 * 2
    folded = llm.score(IDS)
    monkeypatch.setattr(quantize, "FOLD_INPUT_ORDER", False)
    plain = _load(tmp_path / "q")
    assert _gathers(plain) == 4 * 2
    assert torch.equal(plain.score(IDS), folded)


def test_a_bind_stores_int4_codes_in_blocks_with_the_same_logits(bases, tmp_path, monkeypatch):
    """Where a bind stores int4 codes in blocks of 128 inputs (``layers.quantize.store_codes_in_blocks``,
    on CUDA; here on the CPU too), every int4 projection takes the ``-kb`` scheme with ``[blocks, N,
    64]`` codes, after the act-order fold reordered gate/up's rows, and the logits are the same bits;
    binding the same model again row by row restores the plain schemes."""
    from graphdsl.layers import quantize
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=False, act_order=True)
    plain = _load(tmp_path / "q")
    monkeypatch.setattr(quantize, "BLOCK_DEVICES", ("cuda", "cpu"))
    llm = _load(tmp_path / "q")
    params = dict(llm.model.named_parameters())
    qkv, down = params["model.layers.0.self_attn.qkv_proj.weight"], params["model.layers.0.mlp.down_proj.weight"]
    assert (qkv.quant.name, down.quant.name) == ("int4-g32-zp-act-kb", "int4-g32-zp-kb")
    codes = llm.model._bound["model.layers.0.mlp.down_proj.weight_packed"]
    assert codes.dim() == 3 and codes.shape[2] == 64 and codes.shape[1] == down.shape[0]
    assert torch.equal(llm.score(IDS), plain.score(IDS))
    monkeypatch.setattr(quantize, "INT4_BLOCKS", False)
    assert quantize.store_codes_in_blocks(llm.model, llm.model._bound, ("cpu",)) and down.quant.name == "int4-g32-zp"
    assert llm.model._bound["model.layers.0.mlp.down_proj.weight_packed"].dim() == 2


def test_folding_an_input_order_into_a_producer_of_the_wrong_height_is_an_error(bases, tmp_path):
    from graphdsl.layers import quantize
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=False, act_order=True)
    llm = _load(tmp_path / "q")
    layer = llm.model.model.layers[0]
    weights = {"model.layers.0.self_attn.o_proj.weight_perm": torch.arange(128, dtype=torch.int32)}
    object.__setattr__(layer.self_attn.o_proj, "input_order", torch.arange(128))   # as if folded before
    with pytest.raises(GraphDSLError, match=r"fold_input_order: model.layers.0.mlp.gate_up_proj.weight has 512 rows, "
                                            r"expected 2 x 128 for model.layers.0.self_attn.o_proj.weight's input order"):
        quantize.fold_input_order(layer.mlp.gate_up_proj, layer.self_attn.o_proj, weights, parts=2)


def test_lora_on_a_folded_act_order_model_matches_the_unfolded_one(bases, tmp_path, monkeypatch):
    """LoRA adapters of a model whose down_proj order was folded: down's A columns and gate/up's B
    rows take the folded orders, so the adapted logits are those of the unfolded model."""
    pytest.importorskip("peft")
    from graphdsl.layers import quantize
    from tests.models.test_lora import make_adapter
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=False, act_order=True)
    import copy
    make_adapter(copy.deepcopy(bases["llama"]), tmp_path / "ad", seed=5)
    req = gd.LoRARequest("ad", 1, str(tmp_path / "ad"))
    runs = []
    for fold in (True, False):
        monkeypatch.setattr(quantize, "FOLD_INPUT_ORDER", fold)
        llm = _load(tmp_path / "q")
        llm.enable_lora(max_loras=1, max_lora_rank=4)
        runs.append((llm.score(IDS, lora_request=req), llm.score(IDS)))
    (lora_f, base_f), (lora_u, base_u) = runs
    torch.testing.assert_close(lora_f, lora_u, atol=1e-5, rtol=1e-5)
    assert torch.equal(base_f, base_u) and not torch.allclose(lora_f, base_f, atol=1e-2)


def test_gptq_act_order_pieces_of_one_fused_linear_must_share_the_order(bases, tmp_path):
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True, act_order="mismatched")
    with pytest.raises(GraphDSLError, match=r"checkpoint tensors 'model.layers.0.(self_attn.q|mlp.gate)_proj.weight_perm' "
                                            r"and 'model.layers.0.(self_attn.[kv]|mlp.up)_proj.weight_perm' both fill "
                                            r"'model.layers.0.(self_attn.qkv|mlp.gate_up)_proj.weight_perm' but differ: "
                                            r"the pieces of one fused linear must share one input order"):
        _load(tmp_path / "q")


def test_gptq_g_idx_without_desc_act_or_with_unequal_groups_is_an_error(bases, tmp_path):
    from safetensors.torch import load_file, save_file
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True, act_order="shuffled")
    _patch_config(tmp_path / "q", desc_act=False)
    with pytest.raises(GraphDSLError, match=r"'model.layers.0.mlp.down_proj.g_idx' is not the trivial k // "
                                            r"group_size although the config asks no act order"):
        _load(tmp_path / "q")
    _patch_config(tmp_path / "q", desc_act=True)
    f = tmp_path / "q" / "model.safetensors"
    t = load_file(f)
    t["model.layers.0.mlp.down_proj.g_idx"][:3] = 0                    # group 0 takes three more inputs
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(GraphDSLError, match=r"'model.layers.0.mlp.down_proj.g_idx' must give each of the \d+ groups "
                                            r"32 inputs \(act-order\)"):
        _load(tmp_path / "q")
    t["model.layers.0.mlp.down_proj.g_idx"] = t["model.layers.0.mlp.down_proj.g_idx"][:-8].clone()
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(GraphDSLError, match=r"'model.layers.0.mlp.down_proj.g_idx' should have \d+ entries \(one "
                                            r"group per input\), got \d+"):
        _load(tmp_path / "q")


def test_compressed_tensors_group_actorder_needs_int4_groups(bases, tmp_path):
    pytest.importorskip("compressed_tensors")
    write_compressed_tensors(bases["llama"], tmp_path / "q", fmt="pack-quantized", weights=_int(8))
    _set_ct_weights(tmp_path / "q", actorder="group")
    with pytest.raises(GraphDSLError, match=r"actorder 'group' \(a weight_g_idx per input\) applies to int4 group "
                                            r"weights, got int8 strategy 'channel'"):
        _load(tmp_path / "q")


def test_gptq_desc_act_with_trivial_g_idx_loads(bases, tmp_path):
    ref = write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True)
    _patch_config(tmp_path / "q", desc_act=True)
    torch.testing.assert_close(_load(tmp_path / "q").score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("writer,change,match", [
    ("gptq", dict(bits=3), r"'model.layers.0.self_attn.q_proj.qweight' \(gptq int3 g32 sym\): 3-bit GPTQ weights "
                           r"are not supported"),
    ("gptq", dict(group_size=16), r"'model.layers.0.self_attn.q_proj.qweight' \(gptq int4 g16 sym\): int4 group_size "
                                  r"16 is not supported"),
    ("awq", dict(version="gemv"), r"AutoAWQ version/format 'gemv' \(backend None\) is not supported"),
    ("awq", dict(bits=8), r"'model.layers.0.self_attn.q_proj.qweight' \(awq gemm int8 g32\): 8-bit AWQ"),
    ("gptq", dict(quant_method="bitsandbytes"), r"quant_method 'bitsandbytes' is not supported.*\['awq', "
                                                r"'compressed-tensors', 'gptq'\]"),
])
def test_unsupported_scheme_is_an_error(bases, tmp_path, writer, change, match):
    WRITERS[writer](bases["llama"], tmp_path / "q", group=32, **({"sym": True} if writer == "gptq" else {}))
    _patch_config(tmp_path / "q", **change)
    with pytest.raises(GraphDSLError, match=match):
        _load(tmp_path / "q")


def _set_ct_weights(path, **fields):
    """Overwrite fields of a compressed-tensors checkpoint's ``group_0`` weight scheme in config.json."""
    with open(path / "config.json") as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(fields)
    with open(path / "config.json", "w") as f:
        json.dump(config, f)


def test_compressed_tensors_unsupported_bits_is_an_error(bases, tmp_path):
    pytest.importorskip("compressed_tensors")
    write_compressed_tensors(bases["llama"], tmp_path / "q", fmt="pack-quantized", weights=_int(4, group=32))
    _set_ct_weights(tmp_path / "q", num_bits=2)
    with pytest.raises(GraphDSLError, match=r"'model.layers.0.self_attn.q_proj.weight' \(compressed-tensors "
                                            r"pack-quantized int2 group g32\): 2-bit integer weights are not supported"):
        _load(tmp_path / "q")


def test_gptq_group_mismatch_names_the_tensor(bases, tmp_path):
    """The config says groups of 64, the tensors hold groups of 32: a layout mismatch."""
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=False)
    _patch_config(tmp_path / "q", group_size=64)
    with pytest.raises(GraphDSLError, match=r"\(gptq int4 g64\): 'model.layers.0.mlp.down_proj.qzeros' should be "
                                            r"\[4, 16\] torch.int32, got \[8, 16\]"):
        _load(tmp_path / "q")


def test_gptq_sym_with_other_zero_points_is_an_error(bases, tmp_path):
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=False)
    _patch_config(tmp_path / "q", sym=True)
    with pytest.raises(GraphDSLError, match=r"\(gptq int4 g32 sym\): 'model.layers.0.mlp.down_proj.qzeros' holds zero "
                                            r"points other than 8 although sym=true"):
        _load(tmp_path / "q")


def test_fused_pieces_in_different_schemes_are_an_error(bases, tmp_path):
    """q_proj left unquantized while k/v are quantized: they cannot share the packed qkv_proj."""
    pytest.importorskip("compressed_tensors")
    write_compressed_tensors(bases["llama"], tmp_path / "q", fmt="pack-quantized", weights=_int(4, group=32))
    _patch_config(tmp_path / "q", ignore=["lm_head", "re:.*q_proj$"])
    with pytest.raises(GraphDSLError, match=r"'model.layers.0.self_attn.qkv_proj.weight' packs checkpoint linears "
                                            r"stored in different quantization schemes \(model.layers.0.self_attn."
                                            r"q_proj.weight: unquantized, .*k_proj.weight: int4-g32"):
        _load(tmp_path / "q")


def test_missing_quantized_tensor_is_an_error(bases, tmp_path):
    write_awq(bases["llama"], tmp_path / "q", group=32)
    _edit_tensors(tmp_path / "q", lambda t: t.pop("model.layers.1.mlp.down_proj.qzeros"))
    with pytest.raises(GraphDSLError, match=r"quantized linear 'model.layers.1.mlp.down_proj' \(awq gemm int4 g32\): "
                                            r"the checkpoint lacks \['model.layers.1.mlp.down_proj.qzeros'\]"):
        _load(tmp_path / "q")


@pytest.mark.parametrize("writer,kw,scheme", [("awq", dict(group=32), "int4-g32-zp"),
                                               ("gptq", dict(group=32, sym=True, act_order=True), "int4-g32-act"),
                                               ("ct", dict(fmt="pack-quantized", weights=_int(8)), "int8-channel")])
def test_check_model_reads_a_prequantized_checkpoint_as_the_loader_does(bases, tmp_path, writer, kw, scheme):
    """``graphdsl check`` (``check_model``) passes a checkpoint ``LLM`` loads, naming its schemes, and
    reports what the loader would refuse: a missing stored tensor, a quantized tensor of a module the
    config leaves unquantized (here: every tensor of an lm_head written as if quantized)."""
    from graphdsl.models import check_model
    if writer == "ct":
        pytest.importorskip("compressed_tensors")
    _write(bases, tmp_path, "llama", writer, kw)
    report = check_model(tmp_path / "q")
    assert report.ok, str(report)
    assert any("8 linear weights load in" in n and scheme in n for n in report.notes), report.notes
    again = check_model(tmp_path / "q", quantization="int8")         # LLM refuses this pair too
    assert not again.ok and "quantization='int8' given, but the checkpoint is already quantized" in again.problems[-1]
    method = {"ct": "compressed-tensors"}.get(writer, writer)
    named = check_model(tmp_path / "q", quantization=method)        # vLLM's spelling: loads as stored
    assert named.ok and f"quantization={method!r}: the checkpoint's own format" in named.notes[-1], str(named)
    down = "model.layers.1.mlp.down_proj"
    removed = []

    def damage(tensors):
        stored = sorted(n for n in tensors if n.startswith(down + "."))
        removed.append(next(n for n in stored if n.rpartition(".")[2] in ("qzeros", "scales", "weight_scale")))
        del tensors[removed[0]]
        tensors["lm_head." + removed[0].rpartition(".")[2]] = torch.zeros(1)
    _edit_tensors(tmp_path / "q", damage)
    leaf = removed[0]
    report = check_model(tmp_path / "q")
    problems = "\n".join(report.problems)
    assert f"quantized linear {down!r}" in problems and f"the checkpoint lacks [{leaf!r}]" in problems, problems
    assert "'lm_head." in problems and "is stored quantized" in problems, problems
    with pytest.raises(GraphDSLError, match="the checkpoint lacks|is stored quantized"):
        _load(tmp_path / "q")


def test_check_model_finds_stored_tensors_of_the_wrong_shape_or_dtype_from_the_headers(bases, tmp_path):
    """The loader's conversion runs over the tensor headers (meta tensors), so ``graphdsl check``
    reports what ``LLM`` would: a qweight cut short, an int64 qweight, a plain weight beside the
    stored ones; with the same message as the load."""
    from graphdsl.models import check_model
    o = "model.layers.0.self_attn.o_proj"
    cases = {"short": lambda t: t.__setitem__(f"{o}.qweight", t[f"{o}.qweight"][:, :-1].clone()),
             "int64": lambda t: t.__setitem__(f"{o}.qweight", t[f"{o}.qweight"].long()),
             "copy": lambda t: t.__setitem__(f"{o}.weight", torch.zeros(64, 64))}
    for name, damage in cases.items():
        d = tmp_path / name
        write_awq(bases["llama"], d, group=32)
        _edit_tensors(d, damage)
        report = check_model(d)
        assert not report.ok and not any("linear weights load in" in n for n in report.notes), (name, str(report))
        with pytest.raises(GraphDSLError) as load:
            _load(d)
        if name == "copy":
            assert f"'{o}.weight' is unexpected" in report.problems[0] and f"{o}.weight" in str(load.value)
        else:
            assert report.problems == [str(load.value)], (name, report.problems, str(load.value))


def test_config_values_of_the_wrong_json_type_are_refused(bases, tmp_path):
    """``"desc_act": "false"`` must not load as act-order, nor ``"group_size": "32"`` be reported as an
    unsupported group size: a value of the wrong type is an error naming the key."""
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True)
    _patch_config(tmp_path / "q", desc_act="false")
    with pytest.raises(GraphDSLError, match=r"quantization_config.desc_act must be true or false, got 'false'"):
        _load(tmp_path / "q")
    _patch_config(tmp_path / "q", desc_act=None, group_size="32")
    with pytest.raises(GraphDSLError, match=r"quantization_config.group_size must be an integer, got '32'"):
        _load(tmp_path / "q")
    write_awq(bases["llama"], tmp_path / "a", group=32)
    _patch_config(tmp_path / "a", zero_point=1)
    with pytest.raises(GraphDSLError, match=r"quantization_config.zero_point must be true or false, got 1"):
        _load(tmp_path / "a")


def test_non_finite_scales_are_refused_when_loading(bases, tmp_path):
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True)
    _edit_tensors(tmp_path / "q", lambda t: t["model.layers.1.self_attn.v_proj.scales"][0, :3].fill_(float("nan")))
    with pytest.raises(GraphDSLError, match=r"quantized linear 'model.layers.1.self_attn.v_proj' \(gptq int4 g32 "
                                            r"sym\): its scale \('model.layers.1.self_attn.v_proj.weight_scale'\) "
                                            r"holds 3 values that are NaN or infinite"):
        _load(tmp_path / "q")


def test_quantized_tensors_without_a_quantization_config_get_a_hint(bases, tmp_path):
    write_awq(bases["llama"], tmp_path / "q", group=32)
    with open(tmp_path / "q" / "config.json") as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(tmp_path / "q" / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(GraphDSLError, match=r"(?s)42 unexpected.*\.\.\. and 2 more.*hint: the checkpoint holds "
                                            r"quantized tensors \('model\.layers.*qweight', \.\.\.\).*needs the "
                                            r"quantization_config"):
        _load(tmp_path / "q")


def test_awq_modules_to_not_convert_stay_full_precision(bases, tmp_path):
    ref = write_awq(bases["llama"], tmp_path / "q", group=64, modules_to_not_convert=["mlp"])
    llm = _load(tmp_path / "q")
    assert {n for n, p in llm.model.named_parameters() if p.quant is not None} == \
        {f"model.layers.{i}.self_attn.{x}.weight" for i in range(2) for x in ("qkv_proj", "o_proj")}
    torch.testing.assert_close(llm.score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)


def test_online_quantization_of_a_quantized_checkpoint_is_an_error(bases, tmp_path):
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True)
    with pytest.raises(GraphDSLError, match=r"quantization='int8' given, but the checkpoint is already quantized "
                                            r"\(gptq"):
        gd.LLM(tmp_path / "q", device="cpu", quantization="int8")


def test_the_checkpoints_own_format_name_is_accepted_as_in_vllm(bases, tmp_path):
    """vLLM users pass ``quantization="gptq"`` for a GPTQ checkpoint: it loads as stored (the same
    logits as without it); another format's name, or a format's name over full precision, is an
    error saying what to pass."""
    ref = write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True)
    llm = gd.LLM(tmp_path / "q", device="cpu", quantization="gptq")
    assert llm.quantization == _load(tmp_path / "q").quantization
    torch.testing.assert_close(llm.score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)
    with pytest.raises(GraphDSLError, match=r"quantization='awq' given, but the checkpoint is already quantized "
                                            r"\(gptq, .*leave quantization unset or pass 'gptq'"):
        gd.LLM(tmp_path / "q", device="cpu", quantization="awq")
    bases["llama"].save_pretrained(tmp_path / "full")
    with pytest.raises(GraphDSLError, match=r"LLM: quantization='awq' loads a checkpoint stored in that format, but "
                                            r"this one has no quantization_config"):
        gd.LLM(tmp_path / "full", device="cpu", quantization="awq")


def test_quantized_tensor_of_an_unquantized_module_is_an_error(bases, tmp_path):
    """The config leaves the MLP unquantized, the tensors say otherwise: a layout mismatch."""
    write_awq(bases["llama"], tmp_path / "q", group=32)
    _patch_config(tmp_path / "q", modules_to_not_convert=["mlp"])
    with pytest.raises(GraphDSLError, match=r"checkpoint tensor 'model.layers.0.mlp.down_proj.qweight' is stored "
                                            r"quantized \(awq\), but the quantization_config leaves "
                                            r"'model.layers.0.mlp.down_proj' unquantized"):
        _load(tmp_path / "q")


@pytest.mark.parametrize("change,message", [
    # the config says groups of 64, the scales hold groups of 32: a layout mismatch, not a repeat
    (dict(group_size=64), r"\(compressed-tensors pack-quantized int4 group g64\): 'model.layers.0.mlp.down_proj."
                          r"weight_scale' has shape \[128, 8\]; the layout expects \[128, 4\]"),
    # a strategy graphdsl does not read is refused by name, not met later as a scale-shape mismatch
    (dict(strategy="token"), r"'model.layers.0.self_attn.q_proj.weight' \(compressed-tensors pack-quantized int4 "
                             r"token g32\): weight strategy 'token' is not supported \(strategies \['tensor', "
                             r"'channel', 'group'\]"),
])
def test_compressed_tensors_config_mismatch_names_the_tensor(bases, tmp_path, change, message):
    """A config that does not match the stored int4 g32 tensors is an error naming the tensor."""
    pytest.importorskip("compressed_tensors")
    write_compressed_tensors(bases["llama"], tmp_path / "q", fmt="pack-quantized", weights=_int(4, group=32))
    _set_ct_weights(tmp_path / "q", **change)
    with pytest.raises(GraphDSLError, match=message):
        _load(tmp_path / "q")


@pytest.mark.parametrize("writer,kw,leaf,desc", [
    ("awq", dict(group=32), "scales", r"awq gemm int4 g32"),
    ("gptq", dict(group=32, sym=True), "scales", r"gptq int4 g32 sym"),
    ("ct", dict(fmt="pack-quantized", weights=_int(4, group=32)), "weight_scale",
     r"compressed-tensors pack-quantized int4 group g32"),
    ("ct", dict(fmt="float-quantized", weights=dict(num_bits=8, type="float", strategy="channel")), "weight_scale",
     r"compressed-tensors float-quantized float8 channel"),
])
def test_integer_scales_are_refused_not_cast(bases, tmp_path, writer, kw, leaf, desc):
    """A scale stored as integers (a damaged or mislabelled file) used to be cast to float and load:
    every weight of the linear scaled by whole numbers, silently. It is a layout mismatch."""
    if writer == "ct":
        pytest.importorskip("compressed_tensors")
    _write(bases, tmp_path, "llama", writer, kw)
    name = f"model.layers.0.self_attn.k_proj.{leaf}"
    _edit_tensors(tmp_path / "q", lambda t: t.__setitem__(name, (t[name].float() * 1000).to(torch.int32)))
    with pytest.raises(GraphDSLError, match=rf"quantized linear 'model.layers.0.self_attn.k_proj' \({desc}\): "
                                            rf"'{name}' should be a floating-point tensor, got torch.int32"):
        _load(tmp_path / "q")


def test_gptq_desc_act_without_g_idx_is_an_error(bases, tmp_path):
    """With desc_act the groups are g_idx's; a file without g_idx used to load as if the groups were
    contiguous (wrong weights, silently)."""
    write_gptq(bases["llama"], tmp_path / "q", group=32, sym=True, act_order=True)
    _edit_tensors(tmp_path / "q", lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".g_idx")]])
    with pytest.raises(GraphDSLError, match=r"quantized linear 'model.layers.0.self_attn.q_proj' \(gptq int4 g32 sym "
                                            r"desc_act\): the checkpoint lacks \['model.layers.0.self_attn.q_proj."
                                            r"g_idx'\]"):
        _load(tmp_path / "q")


def test_compressed_tensors_tensors_the_layout_does_not_read(bases, tmp_path):
    """A symmetric checkpoint with all-zero ``weight_zero_point`` tensors (as older compressed-tensors
    wrote them) loads; nonzero ones are a layout mismatch, as is a stray full-precision ``weight``
    beside ``weight_packed``. These used to be ignored or, when stored after the module's other
    tensors, reported as the module's scale and codes missing."""
    pytest.importorskip("compressed_tensors")
    ref = write_compressed_tensors(bases["llama"], tmp_path / "q", fmt="pack-quantized", weights=_int(8))

    def zero_points(tensors):
        for k in [k for k in tensors if k.endswith(".weight_scale")]:
            tensors[k[:-len("scale")] + "zero_point"] = torch.zeros(tensors[k].shape, dtype=torch.int8)
    _edit_tensors(tmp_path / "q", zero_points)
    torch.testing.assert_close(_load(tmp_path / "q").score(IDS), hf_logits(ref, IDS), atol=2e-4, rtol=2e-4)
    k_zp = "model.layers.0.self_attn.k_proj.weight_zero_point"
    _edit_tensors(tmp_path / "q", lambda t: t[k_zp].fill_(3))
    with pytest.raises(GraphDSLError, match=rf"quantized linear 'model.layers.0.self_attn.k_proj' \(compressed-tensors "
                                            rf"pack-quantized int8 channel\): '{k_zp}' holds zero points other than 0 "
                                            r"although the config says symmetric"):
        _load(tmp_path / "q")
    _edit_tensors(tmp_path / "q", lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".weight_zero_point")]])
    _edit_tensors(tmp_path / "q", lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 128)))
    with pytest.raises(GraphDSLError, match=r"checkpoint tensor 'model.layers.0.self_attn.k_proj.weight' "
                                            r"\(compressed-tensors pack-quantized int8 channel\): quantized linear "
                                            r"'model.layers.0.self_attn.k_proj' loads as int8-channel, whose stored "
                                            r"layout has no 'weight'"):
        _load(tmp_path / "q")
