"""Registry, config builders, custom module maps, and the to_engine contract."""
import json
import textwrap

import pytest

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from graphdsl.layers import Phase
from graphdsl.models import (FlashCausalLM, build_config, read_hf_config, resolve_model_class, supported_architectures,
                             supported_model_types, to_engine)
from graphdsl.models.llama import LlamaForCausalLM
from tests.models.hf_tiny import hf_logits, make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    model = make_checkpoint("llama", d)
    return d, model


def test_registry_lists_families():
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe"} <= set(supported_model_types())
    assert "Qwen3ForCausalLM" in supported_architectures()
    assert resolve_model_class("mistral", ["MistralForCausalLM"]) is LlamaForCausalLM
    assert resolve_model_class("llama", ["SomethingElse"]) is LlamaForCausalLM     # falls back to model_type


def test_both_hf_config_layouts_give_one_config(ckpt):
    d, _ = ckpt
    hf5 = read_hf_config(d)
    assert "rope_parameters" in hf5
    hf4 = dict(hf5)
    params = hf4.pop("rope_parameters")
    hf4["rope_theta"] = params["rope_theta"]
    assert build_config(hf4) == build_config(hf5)


CUSTOM = '''
from graphdsl.models import ConfigBuilder, ModelConfig, register_config_builder, to_engine
from graphdsl.models.config import dense_fields
from graphdsl.models.llama import LlamaForCausalLM


@register_config_builder
class MyLlamaConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf):
        return hf.get("model_type") == "my_llama"

    @classmethod
    def build(cls, hf):
        return ModelConfig(**dense_fields(hf))


@to_engine()
class MyLlamaForCausalLM(LlamaForCausalLM):
    model_types = ("my_llama",)
    calls = 0

    def _update_model_inputs(self, meta):
        type(self).calls += 1
        return {}, {}, {}


MODULE_MAP = {"MyLlamaForCausalLM": MyLlamaForCausalLM}
'''


def test_custom_module_map_adds_a_model(ckpt, tmp_path):
    src, hf_model = ckpt
    d = tmp_path / "my"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="my_llama", architectures=["MyLlamaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GraphDSLError, match="unknown model_type 'my_llama'"):
        gd.LLM(d, device="cpu")
    module_map = tmp_path / "module_map.py"
    module_map.write_text(textwrap.dedent(CUSTOM))
    llm = gd.LLM(d, device="cpu", max_model_len=32, custom_module_map=module_map)
    assert type(llm.model).__name__ == "MyLlamaForCausalLM"
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = hf_logits(hf_model, ids)
    assert (llm.score(ids) - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert type(llm.model).calls == 1          # the _update_model_inputs hook ran for the step


def test_custom_module_map_errors(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(GraphDSLError, match="failed to import: RuntimeError: boom"):
        gd.models.load_custom_module_map(bad)
    with pytest.raises(GraphDSLError, match="must be an existing .py file"):
        gd.models.load_custom_module_map(tmp_path / "nope.txt")
    worse = tmp_path / "worse.py"
    worse.write_text("MODULE_MAP = {'X': 'graphdsl.models.nothing.Here'}\n")
    with pytest.raises(GraphDSLError, match="cannot import 'graphdsl.models.nothing.Here'"):
        gd.models.load_custom_module_map(worse)


def test_engines_are_built_once_per_phase_and_cached(ckpt):
    d, hf_model = ckpt
    llm = gd.LLM(d, device="cpu", max_model_len=64)
    model = llm.model
    assert model.engine_features == frozenset()
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], gd.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    prefill, decode = model.engine(Phase.PREFILL), model.engine(Phase.DECODE)
    assert set(model._engines) == {(Phase.PREFILL, frozenset()), (Phase.DECODE, frozenset())}
    llm.generate([[9, 9, 9, 9]], gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert model.engine(Phase.PREFILL) is prefill and model.engine(Phase.DECODE) is decode
    # prefill projects only lm_head_indices; decode has no query_start_loc
    assert "lm_head_indices" in prefill.input_names and "query_start_loc" in prefill.input_names
    assert "lm_head_indices" not in decode.input_names and "query_start_loc" not in decode.input_names
    assert "model.layers.0.self_attn.qkv_proj.weight" in prefill.input_names
    assert "k_cache.1" in decode.input_names
    logits = llm.score([5, 6, 7])
    assert logits.shape == (3, 160)


def test_unbound_and_undecorated_models_raise(ckpt):
    d, _ = ckpt
    config = build_config(read_hf_config(d))
    with pytest.raises(GraphDSLError, match="call bind"):
        LlamaForCausalLM(config).engine(Phase.PREFILL)

    class Plain(FlashCausalLM):
        pass

    with pytest.raises(GraphDSLError, match="decorate the class with @to_engine"):
        Plain(config).execute(Phase.DECODE, {})
    with pytest.raises(GraphDSLError, match="to_engine decorates FlashCausalLM subclasses"):
        to_engine()(int)


def test_parameter_names_follow_hf_modules_and_carry_shard_specs(ckpt):
    d, _ = ckpt
    model = LlamaForCausalLM(build_config(read_hf_config(d)))
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].shard_dim == 0
    assert params["model.layers.0.self_attn.o_proj.weight"].shard_dim == 1
    assert params["model.layers.1.mlp.down_proj.weight"].shard_dim == 1
    assert params["model.embed_tokens.weight"].shard_dim == 0
    assert params["model.norm.weight"].shard_dim is None
    table = model.checkpoint_table()
    slot = table["model.layers.0.self_attn.k_proj.weight"]
    assert slot.param == "model.layers.0.self_attn.qkv_proj.weight" and slot.index == (slice(64, 96),)
    assert table["model.layers.1.mlp.up_proj.weight"].index == (slice(96, 192),)
