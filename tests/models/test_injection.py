"""Optimize rules (graphdsl.models.injection): kept modules change nothing, an injected module changes
exactly what it replaces, CPU experts equal the fused ones, and every malformed rule names itself."""
import math
import warnings

import pytest
import torch

import graphdsl as gd
from graphdsl.layers import FusedExperts, RMSNorm
from graphdsl.models.injection import InjectionRuleError, InjectionWarning, apply_rules, load_rules

from tests.models.hf_tiny import make_config

LLAMA = make_config("llama").to_dict()
NORM = "tests.helpers.injected.ScaledRMSNorm"


def _llm(hf=LLAMA, rules=None):
    return gd.LLM.from_config(hf, device="cpu", dtype="float32", max_model_len=64, optimize_rules=rules, seed=3)


def _greedy(llm, n=6):
    return llm.generate([[1, 5, 9, 13]], gd.SamplingParams(max_tokens=n, temperature=0.0))[0].outputs[0].token_ids


def test_default_rules_with_cpu_device_change_nothing():
    base = _llm()
    rules = [{"match": {"name": r"^model\.layers\.\d+\.self_attn$"}, "replace": {"class": "default",
                                                                                  "kwargs": {"device": "cpu"}}},
             {"match": {"class": "graphdsl.layers.RMSNorm"}, "replace": {"kwargs": {"generate_device": "cpu"}}},
             {"match": {"name": "^lm_head$"}, "replace": {"class": "default"}, "recursive": False}]
    injected = _llm(rules=rules)
    assert len(injected.injection.matched) == 2 + 5 + 1
    ids = [1, 7, 3, 11, 2]
    assert torch.equal(base.score(ids), injected.score(ids))
    assert _greedy(base) == _greedy(injected)


def test_injected_norm_replaces_exactly_the_final_norm():
    base = _llm()
    llm = _llm(rules=[{"match": {"name": r"^model\.norm$"}, "replace": {"class": NORM, "kwargs": {"scale": 2.0}}}])
    assert type(llm.model.model.norm).__name__ == "ScaledRMSNorm"
    assert all(type(layer.input_layernorm) is RMSNorm for layer in llm.model.model.layers)
    assert list(llm.injection.matched) == ["model.norm"]
    ids = [1, 7, 3, 11, 2]
    # lm_head is linear without bias: doubling the final norm's output doubles every logit
    torch.testing.assert_close(llm.score(ids), 2.0 * base.score(ids), rtol=1e-5, atol=1e-5)


def test_injected_norm_by_class_matches_every_norm_and_is_recorded():
    llm = _llm(rules=[{"match": {"class": "graphdsl.layers.RMSNorm", "name": r"layernorm$"},
                       "replace": {"class": NORM, "kwargs": {"scale": 1.0}}}])
    assert sorted(llm.injection.matched) == [f"model.layers.{i}.{n}" for i in range(2)
                                             for n in ("input_layernorm", "post_attention_layernorm")]
    ids = [1, 7, 3, 11, 2]
    torch.testing.assert_close(llm.score(ids), _llm().score(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v2"])
def test_cpu_experts_equal_fused_experts(family):
    hf = make_config(family).to_dict()
    rules = [{"match": {"name": r"\.experts$", "class": "graphdsl.layers.FusedExperts"},
              "replace": {"class": "graphdsl.models.cpu_experts.CPUExperts", "kwargs": {"generate_device": "cpu"}},
              "recursive": False}]
    base, cpu = _llm(hf), _llm(hf, rules)
    n_moe = sum(isinstance(m, FusedExperts) for _, m in base.model.named_modules())
    assert len(cpu.injection.matched) == n_moe > 0
    ops = {n.op for n in cpu.model.engine(gd.layers.Phase.PREFILL).net.nodes}
    assert "cpu_moe_experts" in ops and "moe_experts" not in ops
    ids = [1, 7, 3, 11, 2, 9, 4]
    torch.testing.assert_close(cpu.score(ids), base.score(ids), rtol=1e-5, atol=1e-5)
    assert _greedy(base) == _greedy(cpu)


@pytest.mark.parametrize("quantization", ["int8", "int4-g32", "int4-g32-zp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_experts_hold_int8_and_int4_codes(quantization, dtype):
    """Under online int8 / int4 the host keeps the stacks' codes (a half / a quarter of their bytes)
    and equals the quantized fused experts: exactly in float32 (each chosen expert dequantized), and
    through torch's CPU weight-only kernels within bf16's rounding."""
    hf = make_config("mixtral", intermediate_size=64).to_dict()
    kw = dict(device="cpu", dtype=dtype, max_model_len=64, seed=3, quantization=quantization)
    base = gd.LLM.from_config(hf, **kw)
    cpu = gd.LLM.from_config(hf, optimize_rules=CPU_RULES, **kw)
    experts = cpu.model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "CPUExperts" and experts.gate_up_proj.quant.name.startswith(quantization[:4])
    up = experts.host_weights[0]
    dense = base.model._bound["model.layers.0.mlp.experts.gate_up_proj_scale"].element_size()   # the model dtype's
    codes = up.rows * up.inputs * up.experts * (1 if quantization == "int8" else 0.5)
    assert codes <= up.nbytes() < 2 * codes, "the host holds one copy of the codes (and their scales)"
    assert up.nbytes() < math.prod(experts.gate_up_proj.shape) * dense
    assert (up.kernel is not None) == (dtype == "bfloat16")
    ids = [1, 7, 3, 11, 2, 9, 4]
    want, got = base.score(ids), cpu.score(ids)
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_cpu_experts_keep_fp8_stacks_in_the_model_dtype(caplog):
    """No CPU kernel reads fp8 codes: under fp8 the host stacks stay full precision, with the warning."""
    hf = make_config("mixtral").to_dict()
    with caplog.at_level("WARNING", logger="graphdsl.quant"):
        cpu = gd.LLM.from_config(hf, device="cpu", dtype="float32", max_model_len=64, seed=3, quantization="fp8",
                                 optimize_rules=CPU_RULES)
    assert cpu.model.model.layers[0].mlp.experts.gate_up_proj.quant is None
    assert any("MoE expert stacks" in r.getMessage() for r in caplog.records)
    assert cpu.model.model.layers[0].self_attn.qkv_proj.weight.quant.name == "fp8-channel"


CPU_RULES = [{"match": {"name": r"\.experts$", "class": "graphdsl.layers.FusedExperts"},
              "replace": {"class": "graphdsl.models.cpu_experts.CPUExperts", "kwargs": {"generate_device": "cpu"}},
              "recursive": False}]


# -- malformed rules: each names the rule index, the field and the value -------------------------
_BAD = [
    ([{"match": {"name": "x"}, "replce": {}}], "optimize rule 0: field 'replce'", "not a known key"),
    ([{"match": {"name": "x", "klass": "a.B"}}], "optimize rule 0: field 'match.klass'", "not a known key"),
    ([{"match": {"name": "x"}}, {"match": {"name": "model.(layers"}}], "optimize rule 1: field 'match.name'",
     "'model.(layers'"),
    ([{"match": {"class": "graphdsl.layers.NoSuchNorm"}}], "optimize rule 0: field 'match.class'", "does not import"),
    ([{"match": {"name": "x"}, "replace": {"class": "no_such_pkg.Mod"}}], "optimize rule 0: field 'replace.class'",
     "'no_such_pkg.Mod'"),
    ([{"match": {"name": "x"}, "replace": {"class": NORM, "kwargs": {"scael": 2}}}],
     "optimize rule 0: field 'replace.kwargs'", "scael"),
    ([{"match": {"name": "x"}, "replace": {"kwargs": {"generate_op": "foo"}}}],
     "optimize rule 0: field 'replace.kwargs'", "'generate_op'"),
    ([{"match": {"name": "x"}, "replace": {"kwargs": {"device": "gpu7"}}}],
     "optimize rule 0: field 'replace.kwargs.device'", "'gpu7'"),
    ([{"match": {"name": "x"}, "recursive": "sometimes"}], "optimize rule 0: field 'recursive'", "'sometimes'"),
    ([{"match": {}}], "optimize rule 0: field 'match'", "needs 'name' and/or 'class'"),
    ({"match": {}}, "expected a list of rules", "dict"),
]


@pytest.mark.parametrize("rules,where,what", _BAD, ids=[b[1].split("field ")[-1] + str(i) for i, b in enumerate(_BAD)])
def test_malformed_rules_name_index_field_and_value(rules, where, what):
    with pytest.raises(InjectionRuleError) as e:
        load_rules(rules)
    msg = str(e.value)
    assert where in msg and what in msg
    assert "validation error" not in msg and "pydantic" not in msg


def test_rule_file_and_yaml_string(tmp_path):
    text = "- match:\n    name: '^model\\.norm$'\n  replace:\n    class: default\n    kwargs: {device: cpu}\n"
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    assert load_rules(str(path)) == load_rules(path) == load_rules(text)
    assert load_rules(text)[0].match.name == r"^model\.norm$"
    with pytest.raises(InjectionRuleError, match="no such rule file"):
        load_rules(str(tmp_path / "missing.yaml"))


def test_rule_matching_nothing_warns_and_first_match_wins():
    llm = _llm()
    rules = [{"match": {"name": r"^model\.norm$"}, "replace": {"class": NORM, "kwargs": {"scale": 3.0}}},
             {"match": {"class": "graphdsl.layers.RMSNorm"}, "replace": {"class": NORM, "kwargs": {"scale": 5.0}}},
             {"match": {"name": "^nothing_here$"}}]
    with pytest.warns(InjectionWarning, match=r"optimize rule 2 \(name='\^nothing_here\$'\) matched no module"):
        report = apply_rules(llm.model, rules)
    assert llm.model.model.norm.scale == 3.0
    assert {llm.model.model.layers[0].input_layernorm.scale} == {5.0}
    assert report.unmatched_rules == [2]


def test_non_recursive_rule_stops_descent():
    llm = _llm()
    rules = [{"match": {"name": r"^model\.layers\.0$"}, "recursive": False},
             {"match": {"class": "graphdsl.layers.RMSNorm"}, "replace": {"class": NORM}}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_rules(llm.model, rules)
    assert type(llm.model.model.layers[0].input_layernorm) is RMSNorm
    assert type(llm.model.model.layers[1].input_layernorm).__name__ == "ScaledRMSNorm"


def test_kept_module_placements_are_checked():
    with pytest.raises(InjectionRuleError, match=r"'model.norm' \(RMSNorm\) with generate_device='cpu' and "
                                                 r"prefill_device='cpu:1'; .* both must be equal"):
        _llm(rules=[{"match": {"name": r"^model\.norm$"},
                     "replace": {"kwargs": {"generate_device": "cpu", "prefill_device": "cpu:1"}}}])
    if not torch.cuda.is_available():
        with pytest.raises(InjectionRuleError, match=r"'model.norm' \(RMSNorm\) on 'cuda:1', but this machine has "
                                                     r"no CUDA device"):
            _llm(rules=[{"match": {"name": r"^model\.norm$"}, "replace": {"kwargs": {"device": "cuda:1"}}}])


# -- entry points: checkpoints (safetensors, GGUF) bind injected modules' weights by name ------------
EXPERTS_CPU = [{"match": {"name": r"^model\.layers\.\d+\.mlp\.experts$"},
                "replace": {"class": "graphdsl.models.cpu_experts.CPUExperts", "kwargs": {"generate_device": "cpu"}},
                "recursive": False}]


def test_safetensors_checkpoint_binds_cpu_experts(tmp_path):
    from tests.models.hf_tiny import make_checkpoint
    make_checkpoint("qwen2_moe", tmp_path)
    base = gd.LLM(tmp_path, device="cpu", max_model_len=64)
    cpu = gd.LLM(tmp_path, device="cpu", max_model_len=64, optimize_rules=EXPERTS_CPU)
    assert type(cpu.model.model.layers[0].mlp.experts).__name__ == "CPUExperts"
    ids = [3, 1, 4, 1, 5, 9]
    torch.testing.assert_close(cpu.score(ids), base.score(ids), rtol=1e-5, atol=1e-5)


def test_cli_optimize_rules_on_a_gguf_model(tmp_path, capsys, monkeypatch):
    from graphdsl.entrypoints.cli import main
    from tests.models.gguf_tiny import build_tiny_gguf
    monkeypatch.delenv("GRAPHDSL_DUMP_DIR", raising=False)
    gguf, _ = build_tiny_gguf(tmp_path)
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"- match: {{name: '^model\\.norm$'}}\n  replace: {{class: {NORM}, kwargs: {{scale: 2.0}}}}\n")
    assert main(["dump", str(gguf), "--out", str(tmp_path / "out"), "--optimize-rules", str(rules)]) == 0
    assert "optimize rules: 1 modules matched" in capsys.readouterr().err
    assert "(norm): ScaledRMSNorm" in (tmp_path / "out" / "model.txt").read_text()


# -- placement: a transfer_map splits the layer stack into per-device engines ------------------------
SPLIT = [{"match": {"name": "^model$"}, "replace": {"class": "default", "kwargs": {"transfer_map": {1: "cpu:1"}}}}]


HEAD_BACK = [{"match": {"name": "^lm_head$"}, "replace": {"kwargs": {"device": "cpu"}}}]


@pytest.mark.parametrize("family,rules,devices", [
    ("llama", SPLIT, ["cpu", "cpu:1", "cpu"]),                # unplaced norm/lm_head run where their weights are
    ("llama", SPLIT + HEAD_BACK, ["cpu", "cpu:1", "cpu"]),    # a placed lm_head: the same
    ("qwen2_moe", SPLIT + EXPERTS_CPU, ["cpu", "cpu:1", "cpu"])],
    ids=["llama", "llama-head-back", "qwen2_moe-cpu-experts"])
def test_transfer_map_split_equals_unsplit(family, rules, devices):
    hf = LLAMA if family == "llama" else make_config(family).to_dict()
    base = _llm(hf)
    split = _llm(hf, rules)
    assert split.model.layer_devices("cpu") == ["cpu", "cpu:1"]
    for phase in gd.layers.Phase:
        engine = split.model.engine(phase)
        parts = engine.partition.parts
        assert [p.device for p in parts] == devices
        assert sum(n.op == "transfer" for n in engine.net.nodes) >= len(devices) - 1
        # KV cache blocks live with their attention layer's part
        assert "k_cache.0" in parts[0].net.inputs and "k_cache.1" in parts[1].net.inputs
        assert "k_cache.1" not in parts[0].net.inputs
    ids = [1, 7, 3, 11, 2]
    if rules is SPLIT or family == "llama":        # the split alone is exact; CPU experts round differently
        assert torch.equal(split.score(ids), base.score(ids))
    else:
        torch.testing.assert_close(split.score(ids), base.score(ids), rtol=1e-5, atol=1e-5)
    assert _greedy(split) == _greedy(base)


def test_transfer_map_errors_name_the_rule():
    with pytest.raises(InjectionRuleError, match=r"optimize rule 0: field 'replace.kwargs.transfer_map' has layer "
                                                 r"index 5, but 'model.layers' has 2 layers"):
        _llm(rules=[{"match": {"name": "^model$"}, "replace": {"kwargs": {"transfer_map": {5: "cpu:1"}}}}])
    with pytest.raises(InjectionRuleError, match=r"optimize rule 0: field 'replace.kwargs.transfer_map' needs a "
                                                 r"module with a 'layers' list, but 'lm_head'"):
        _llm(rules=[{"match": {"name": "^lm_head$"}, "replace": {"kwargs": {"transfer_map": {0: "cpu:1"}}}}])
    with pytest.raises(InjectionRuleError, match=r"optimize rule 0: field 'replace.kwargs.transfer_map.1' must be "
                                                 r"a device .*got 'gpu'"):
        load_rules([{"match": {"name": "^model$"}, "replace": {"kwargs": {"transfer_map": {1: "gpu"}}}}])


@pytest.mark.parametrize("name", ["moe-experts-cpu", "moe-two-gpu"])
def test_shipped_rule_files_load(name):
    from graphdsl.models.injection import builtin_rules
    rules = load_rules(builtin_rules(name))
    assert rules and all(r.match.name for r in rules)
    with pytest.raises(InjectionRuleError, match=r"builtin_rules: name must be one of \['moe-experts-cpu', "
                                                 r"'moe-two-gpu'\], got 'nope'"):
        builtin_rules("nope")


def test_replacement_class_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_norm.py").write_text("from tests.helpers.injected import ScaledRMSNorm as Norm\n")
    monkeypatch.chdir(tmp_path)
    llm = _llm(rules=[{"match": {"name": r"^model\.norm$"}, "replace": {"class": "my_norm.py:Norm"}}])
    assert type(llm.model.model.norm).__name__ == "ScaledRMSNorm"
    with pytest.raises(InjectionRuleError, match=r"optimize rule 0: field 'replace.class' does not import "
                                                 r"\(FileNotFoundError: .*got 'nope.py:Norm'"):
        load_rules([{"match": {"name": "x"}, "replace": {"class": "nope.py:Norm"}}])


def test_check_applies_rules_before_comparing_weights(tmp_path, capsys):
    from graphdsl.entrypoints.cli import main
    from graphdsl.models.check import check_model
    from tests.models.gguf_tiny import build_tiny_gguf
    gguf, _ = build_tiny_gguf(tmp_path)
    ok = [{"match": {"name": r"^model\.norm$"}, "replace": {"class": NORM}}]
    renamed = [{"match": {"name": r"^model\.norm$"}, "replace": {"class": "tests.helpers.injected.RenamedNorm"}}]
    assert check_model(gguf, optimize_rules=ok).ok
    report = check_model(gguf, optimize_rules=renamed)
    assert not report.ok and "model.norm.gain" in str(report) and "model.norm.weight" in str(report)
    rules = tmp_path / "renamed.yaml"
    rules.write_text("- match: {name: '^model\\.norm$'}\n  replace: {class: tests.helpers.injected.RenamedNorm}\n")
    assert main(["check", str(gguf), "--optimize-rules", str(rules)]) == 1
    assert "model.norm.gain" in capsys.readouterr().out


def test_partitioned_graph_runner_steps_equal_the_engine():
    """The per-part decode runner (CUDA graphs per CUDA part; host parts eager, as here) gives the
    partitioned engine's logits for a padded decode batch."""
    from graphdsl.models.base import decode_pads
    from graphdsl.models.partitioned_graphs import PartitionedGraphRunner
    split = _llm(rules=SPLIT)
    engine = split.model.engine(gd.layers.Phase.DECODE)
    runner = PartitionedGraphRunner(engine, decode_pads(4))
    assert runner.runners == [None, None, None]            # host parts run eagerly
    assert {"input_ids", "cos", "slot_mapping", "block_tables", "seq_lens"} <= set(runner.pads)
    pos = torch.tensor([0, 0])
    step = {"input_ids": torch.tensor([5, 9]), "positions": pos, "slot_mapping": torch.tensor([0, 16]),
            "block_tables": torch.tensor([[0], [1]], dtype=torch.int32), "seq_lens": torch.tensor([1, 1], dtype=torch.int32)}
    step["cos"], step["sin"] = split.model.rotary.cos_sin(pos)
    step = {k: v for k, v in step.items() if k in engine.net.inputs}
    assert runner.fits(step) and not runner.fits({**step, "block_tables": torch.zeros(2, 5, dtype=torch.int32)})
    assert torch.equal(runner.run(step)["logits"], engine.forward(step)["logits"])


def test_cpu_experts_survive_an_op_registry_reset(monkeypatch):
    """A registry reset (the docs test isolates each doc's ops) after the module was imported must not
    leave CPUExperts recording an unknown op."""
    from graphdsl import opdef
    import graphdsl.models.cpu_experts  # noqa: F401  (registers the op)
    monkeypatch.setattr(opdef, "_REGISTRY", {k: v for k, v in opdef._REGISTRY.items() if k != "cpu_moe_experts"})
    hf = make_config("qwen2_moe").to_dict()
    llm = _llm(hf, EXPERTS_CPU)
    assert llm.score([1, 2, 3]).shape == (3, hf["vocab_size"])
