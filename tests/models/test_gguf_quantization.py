"""``LLM(path.gguf, quantization="gguf")`` keeps the file's blocks: a tiny Llama written the llama.cpp
way with Q8_0 / Q4_0 / Q4_1 matrices scores like the same file dequantized on load (the weights are
the same values, only where they are decoded moves), its graphs record ``quant_linear`` with the
file's block types (a packed weight whose parts differ in type keeps each part's), a float matrix
stays dense (and a log line says so), and ``quantization="gguf"`` on a HF directory is an error."""
import logging

import pytest
import torch

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from graphdsl.layers import Phase
from tests.models.hf_tiny import make_checkpoint

IDS = [3, 17, 42, 90, 5, 64, 7, 11]


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    from gguf import GGMLQuantizationType as Q

    from tests.helpers.gguf_files import hf_model_to_gguf
    from tests.models.test_gguf import _tok_meta
    d = tmp_path_factory.mktemp("ggufq")
    hf = make_checkpoint("llama", d / "hf", vocab_size=96)
    quant = {r"layers\.0\.self_attn\.v_proj": Q.Q4_0, r"layers\.1\.self_attn\.o_proj": None, r"self_attn": Q.Q8_0,
             r"gate_proj|up_proj": Q.Q4_1, r"down_proj": Q.Q4_0, r"lm_head": Q.Q8_0}
    hf_model_to_gguf(d / "q.gguf", hf, "llama", tokenizer_meta=_tok_meta(96), quant=quant)
    return d


def test_kept_blocks_score_like_the_dequantized_file(quantized_gguf, caplog):
    path = str(quantized_gguf / "q.gguf")
    with caplog.at_level(logging.WARNING, logger="graphdsl.gguf"):
        llm = gd.LLM(path, device="cpu", quantization="gguf", max_model_len=64, max_num_seqs=1)
    kept = {n: p.quant.name for n, p in llm.model.named_parameters() if p.quant is not None}
    # layer 0's q/k (Q8_0, 64 + 32 rows) and v (Q4_0, 32 rows) keep their types side by side
    assert kept == {"model.layers.0.self_attn.qkv_proj.weight": "gguf-q8_0.96+q4_0.32",
                    "model.layers.0.self_attn.o_proj.weight": "gguf-q8_0",
                    "model.layers.0.mlp.gate_up_proj.weight": "gguf-q4_1",
                    "model.layers.0.mlp.down_proj.weight": "gguf-q4_0",
                    "model.layers.1.self_attn.qkv_proj.weight": "gguf-q8_0",
                    "model.layers.1.mlp.gate_up_proj.weight": "gguf-q4_1",
                    "model.layers.1.mlp.down_proj.weight": "gguf-q4_0"}
    # layer 1's o_proj is F32 in the file: dequantized, and said so
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "7 of 8 weights (linears, expert stacks) keep their GGUF blocks" in msg
    assert "model.layers.1.self_attn.o_proj.weight (F32 in the file)" in msg
    bound = llm.model._bound
    packed = bound["model.layers.1.self_attn.qkv_proj.weight_packed"]
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (64 + 2 * 32, 64 // 32 * 34)
    assert tuple(bound["model.layers.0.self_attn.qkv_proj.weight_packed"].shape) == (96, 2 * 34)
    assert tuple(bound["model.layers.0.self_attn.qkv_proj.weight_packed1"].shape) == (32, 2 * 18)
    assert "model.layers.1.self_attn.qkv_proj.weight" not in bound
    assert bound["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float32
    assert bound["lm_head.weight"].dtype == torch.float32          # lm_head: dequantized as today
    ours = llm.score(IDS)
    graph = str(llm.model.engine(Phase.PREFILL).net)
    assert "scheme=gguf-q4_1" in graph and "scheme=gguf-q4_0" in graph and "scheme=gguf-q8_0.96+q4_0.32" in graph
    dense = gd.LLM(path, device="cpu", max_model_len=64, max_num_seqs=1)
    ref = dense.score(IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
    params = gd.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert llm.generate([IDS], params)[0].outputs[0].token_ids == dense.generate([IDS], params)[0].outputs[0].token_ids


def test_a_bind_stores_the_blocks_block_major_with_the_same_logits(quantized_gguf, monkeypatch):
    """Where a bind stores GGUF blocks block-major (``layers.quantize.store_codes_in_blocks``, on
    CUDA; here on the CPU too), every kept weight takes the ``-kb`` scheme with ``[blocks, N, block
    bytes]`` parts (a mixed qkv's each), the logits are the same bits, and binding the model again
    row by row restores the plain schemes and rows."""
    from graphdsl.layers import quantize
    path = str(quantized_gguf / "q.gguf")
    plain = gd.LLM(path, device="cpu", quantization="gguf", max_model_len=64, max_num_seqs=1)
    monkeypatch.setattr(quantize, "BLOCK_DEVICES", ("cuda", "cpu"))
    llm = gd.LLM(path, device="cpu", quantization="gguf", max_model_len=64, max_num_seqs=1)
    params = dict(llm.model.named_parameters())
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.quant.name == "gguf-q8_0.96+q4_0.32-kb"
    assert params["model.layers.0.mlp.down_proj.weight"].quant.name == "gguf-q4_0-kb"
    bound = llm.model._bound
    assert tuple(bound["model.layers.0.self_attn.qkv_proj.weight_packed"].shape) == (2, 96, 34)
    assert tuple(bound["model.layers.0.self_attn.qkv_proj.weight_packed1"].shape) == (2, 32, 18)
    assert "scheme=gguf-q8_0.96+q4_0.32-kb" in str(llm.model.engine(Phase.PREFILL).net)
    assert torch.equal(llm.score(IDS), plain.score(IDS))
    monkeypatch.setattr(quantize, "GGUF_BLOCKS", False)
    changed = quantize.store_codes_in_blocks(llm.model, bound, ("cpu",))
    assert len(changed) == 7 and qkv.quant.name == "gguf-q8_0.96+q4_0.32"
    assert torch.equal(bound["model.layers.0.self_attn.qkv_proj.weight_packed1"],
                       plain.model._bound["model.layers.0.self_attn.qkv_proj.weight_packed1"])


def test_gguf_quantization_needs_a_gguf_file(quantized_gguf):
    with pytest.raises(GraphDSLError, match=r"quantization='gguf' keeps the blocks of a GGUF file, but the model is "
                                            r".*hf.*not a \.gguf file"):
        gd.LLM(str(quantized_gguf / "hf"), device="cpu", quantization="gguf")
    with pytest.raises(GraphDSLError, match=r"quantization='gguf'.*LLM\.from_config"):
        gd.LLM.from_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                            "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "vocab_size": 96}, device="cpu", quantization="gguf")


def test_block_weights_need_block_tensors(quantized_gguf):
    """A weight marked to keep blocks but fed a dense tensor is an error naming both (not a KeyError)."""
    from graphdsl.models.gguf_weights import keep_gguf_blocks
    from graphdsl.models.loader import load_weights
    from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
    llm = gd.LLM(str(quantized_gguf / "q.gguf"), device="cpu", max_model_len=64, max_num_seqs=1)
    model = type(llm.model)(llm.config, torch.float32)
    ckpt = GGUFCheckpoint(str(quantized_gguf / "q.gguf"))
    blocks = keep_gguf_blocks(model, ckpt.block_types())
    with pytest.raises(GraphDSLError, match=r"checkpoint tensor 'model.layers.0.self_attn.q_proj.weight' is not in "
                                            r"GGUF blocks, but .*qkv_proj.weight' \(gguf-q8_0.96\+q4_0.32\) keeps them"):
        load_weights(model, ckpt.iter_tensors(), device="cpu", blocks=blocks)


def _tiny_mixtral_gguf(path, quant):
    from tests.helpers.gguf_files import hf_model_to_gguf
    from tests.models.test_gguf import _tok_meta, tiny_mixtral
    hf_model_to_gguf(path, tiny_mixtral(4), "llama", tokenizer_meta=_tok_meta(96), quant=quant)


def test_expert_stacks_keep_their_blocks(tmp_path, caplog):
    """A Mixtral file's experts in Q8_0 (gate, up) and Q4_0 (down) stay in those blocks: each
    stack is uint8 ``[experts, rows, row bytes]``, the graph records ``quant_moe_experts`` on
    them, and the model scores like the same file dequantized on load; no warning says experts
    are dequantized."""
    from gguf import GGMLQuantizationType as Q
    path = tmp_path / "mixtral.gguf"
    _tiny_mixtral_gguf(path, {r"experts\.gate_up_proj": Q.Q8_0, r"experts\.down_proj": Q.Q4_0, r"self_attn": Q.Q8_0})
    with caplog.at_level(logging.WARNING, logger="graphdsl.gguf"):
        llm = gd.LLM(str(path), device="cpu", quantization="gguf", max_model_len=64, max_num_seqs=1)
    assert "MoE expert stacks" not in caplog.text
    from graphdsl.models import check_model
    report = check_model(path, quantization="gguf")        # graphdsl check --quantization gguf: the same rule
    assert report.ok and report.notes == ["quantization='gguf': 8 weights keep the file's blocks "
                                          "(gguf-q8_0 x6, gguf-q4_0 x2)"], str(report)
    kept = {n: p.quant.name for n, p in llm.model.named_parameters() if ".experts." in n and p.quant is not None}
    assert kept == {f"model.layers.{i}.mlp.experts.{s}": q for i in range(2)
                    for s, q in (("gate_up_proj", "gguf-q8_0"), ("down_proj", "gguf-q4_0"))}
    bound = llm.model._bound
    assert tuple(bound["model.layers.1.mlp.experts.gate_up_proj_packed"].shape) == (8, 64, 64 // 32 * 34)
    assert tuple(bound["model.layers.1.mlp.experts.down_proj_packed"].shape) == (8, 64, 32 // 32 * 18)
    assert "model.layers.1.mlp.experts.down_proj" not in bound
    graph = str(llm.model.engine(Phase.PREFILL).net)
    assert "gate_up_scheme=gguf-q8_0" in graph and "down_scheme=gguf-q4_0" in graph
    ours = llm.score(IDS)
    dense = gd.LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=1)
    ref = dense.score(IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_expert_stacks_in_mixed_types_are_dequantized_together(tmp_path, caplog):
    """gate in Q8_0 beside up in Q4_0 cannot be one stack's blocks: that layer's gate/up stack is
    dequantized, and its down stack with it (a layer's two stacks keep their blocks together); the
    log line says why for each."""
    from gguf import GGMLQuantizationType as Q
    path = tmp_path / "mixtral.gguf"
    _tiny_mixtral_gguf(path, {r"experts\.gate_up_proj": Q.Q8_0, r"experts\.down_proj": Q.Q4_0, r"self_attn": Q.Q8_0})
    # layer 0's up experts as Q4_0: the file read back and written again with that one tensor changed
    from gguf import GGUFReader, quants

    from tests.helpers.gguf_files import write_gguf
    reader = GGUFReader(str(path))
    tensors = {}
    for t in reader.tensors:
        data = quants.dequantize(t.data, t.tensor_type) if t.tensor_type != Q.F32 else t.data
        qtype = None if t.tensor_type == Q.F32 else t.tensor_type
        if t.name == "blk.0.ffn_up_exps.weight":
            qtype = Q.Q4_0
        tensors[t.name] = (quants.quantize(data, qtype), qtype) if qtype is not None else (data, None)
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    mixed = tmp_path / "mixed.gguf"
    write_gguf(mixed, "llama", {k: v for k, v in meta.items() if k != "general.architecture"}, tensors)
    with caplog.at_level(logging.WARNING, logger="graphdsl.gguf"):
        llm = gd.LLM(str(mixed), device="cpu", quantization="gguf", max_model_len=64, max_num_seqs=1)
    params = dict(llm.model.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].quant is None
    assert params["model.layers.0.mlp.experts.down_proj"].quant is None
    assert params["model.layers.1.mlp.experts.gate_up_proj"].quant.name == "gguf-q8_0"
    assert "model.layers.0.mlp.experts.gate_up_proj (its pieces are in different block types (Q4_0, " \
           "Q8_0))" in caplog.text
    assert "model.layers.0.mlp.experts.down_proj (its layer's other expert stack is dequantized)" in caplog.text
    assert "2 MoE expert stacks (" in caplog.text
    from graphdsl.models import check_model
    assert "; 2 MoE expert stacks are dequantized" in check_model(mixed, quantization="gguf").notes[0]


def test_expert_stacks_of_a_module_that_does_not_run_blocks_are_dequantized(tmp_path, caplog):
    """Experts injected onto the host (``CPUExperts``, which runs int8/int4 codes only) take the
    file's expert blocks dequantized, the log saying why; the model scores like the file dequantized."""
    from gguf import GGMLQuantizationType as Q

    from tests.models.test_injection import EXPERTS_CPU
    path = tmp_path / "mixtral.gguf"
    _tiny_mixtral_gguf(path, {r"experts\.gate_up_proj": Q.Q8_0, r"experts\.down_proj": Q.Q4_0, r"self_attn": Q.Q8_0})
    with caplog.at_level(logging.WARNING, logger="graphdsl.gguf"):
        llm = gd.LLM(str(path), device="cpu", quantization="gguf", max_model_len=64, max_num_seqs=1,
                     optimize_rules=EXPERTS_CPU)
    experts = llm.model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "CPUExperts" and experts.gate_up_proj.quant is None
    assert ("model.layers.0.mlp.experts.gate_up_proj (CPUExperts runs int8-channel and int4-g{32,64,128}[-zp] "
            "stacks)") in caplog.text
    ref = gd.LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=1).score(IDS)
    torch.testing.assert_close(llm.score(IDS), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
