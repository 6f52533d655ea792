"""Bad inputs give one clear GraphDSLError naming what is wrong, expected and actual."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from graphdsl.models import check_model
from tests.models.hf_tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", d)
    return d


@pytest.fixture(scope="module")
def llm(ckpt):
    return gd.LLM(ckpt, device="cpu", max_model_len=32)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_model_type_lists_supported(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GraphDSLError, match="unknown model_type 'gpt_bigcode'") as e:
        gd.LLM(d, device="cpu")
    for name in ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe"):
        assert f"'{name}'" in str(e.value)
    report = check_model(d)
    assert not report.ok and "gpt_bigcode" in str(report)


def test_missing_unexpected_and_wrong_shape_weights_listed_together(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:-1].contiguous()
    sd["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(GraphDSLError) as e:
        gd.LLM(d, device="cpu")
    msg = str(e.value)
    assert "1 missing" in msg and "model.layers.1.self_attn.k_proj.weight: expected shape [32, 64]" in msg
    assert "model.layers.0.mlp.up_proj.weight: expected shape [96, 64], got [95, 64]" in msg
    assert "model.layers.0.extra.weight" in msg
    report = check_model(d)
    assert not report.ok and "k_proj" in str(report)


def test_check_model_reports_unsupported_features(ckpt, tmp_path):
    assert check_model(ckpt).ok
    d = _copy(ckpt, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0],
                              "long_factor": [1.0]}
    (d / "config.json").write_text(json.dumps(cfg))
    report = check_model(d)
    assert not report.ok and "rope type 'longrope' is not supported" in str(report)
    with pytest.raises(GraphDSLError, match="longrope"):
        gd.LLM(d, device="cpu")


def test_a_quantization_config_over_full_precision_weights_names_the_missing_tensors(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (d / "config.json").write_text(json.dumps(cfg))
    want = (r"quantized linear 'model.layers.0.self_attn.q_proj' \(awq gemm int4 g32\): the checkpoint lacks "
            r"\['model.layers.0.self_attn.q_proj.qweight', 'model.layers.0.self_attn.q_proj.qzeros', "
            r"'model.layers.0.self_attn.q_proj.scales'\]")
    report = check_model(d)
    assert not report.ok and re.search(want, str(report)), str(report)
    with pytest.raises(GraphDSLError, match=want):
        gd.LLM(d, device="cpu")


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(GraphDSLError, match="prompt 0 has 40 tokens, more than max_model_len=32"):
        llm.generate([list(range(1, 41))], gd.SamplingParams(max_tokens=2))
    with pytest.raises(GraphDSLError, match="has 33 tokens, more than max_model_len=32"):
        llm.score(list(range(1, 34)))
    assert llm.score(list(range(1, 33))).shape == (32, 160)      # exactly max_model_len is fine


def test_output_is_capped_by_max_model_len(llm):
    out = llm.generate([list(range(1, 30))], gd.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_empty_prompts(llm):
    with pytest.raises(GraphDSLError, match="prompt 0 is empty"):
        llm.generate([[]], gd.SamplingParams())
    with pytest.raises(GraphDSLError, match="token_ids is empty"):
        llm.score([])
    with pytest.raises(GraphDSLError, match="prompts must be a non-empty list"):
        llm.generate([], gd.SamplingParams())
    with pytest.raises(GraphDSLError, match="needs a tokenizer"):   # this checkpoint has no tokenizer.json
        llm.generate("hello", gd.SamplingParams())


def test_token_ids_outside_vocab(llm):
    with pytest.raises(GraphDSLError, match=r"outside \[0, 160\): \[160, -1\]"):
        llm.score([1, 160, -1])


@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", -0.5, "temperature must be a float >= 0"),
    ("top_p", 0.0, "top_p must be a float in (0, 1]"),
    ("top_p", 1.5, "top_p must be a float in (0, 1]"),
    ("top_k", -2, "top_k must be an integer >= -1"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a float > 0"),
])
def test_out_of_range_sampling_params(llm, field, value, allowed):
    with pytest.raises(GraphDSLError) as e:
        gd.SamplingParams(**{field: value})
    assert allowed in str(e.value) and repr(value) in str(e.value)
    with pytest.raises(GraphDSLError, match="invalid SamplingParams"):
        llm.generate([[1, 2]], {field: value})


def test_wrong_params_count(llm):
    with pytest.raises(GraphDSLError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate([[1, 2]], [gd.SamplingParams(), gd.SamplingParams()])


def test_corrupt_safetensors(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(GraphDSLError, match="model.safetensors"):
        gd.LLM(d, device="cpu")
    (d / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(GraphDSLError, match="not a readable safetensors file"):
        gd.LLM(d, device="cpu")


def test_tensor_names_of_a_corrupt_file_name_the_file(tmp_path):
    """The names pre-quantized configs' patterns are matched against come from the headers: a file
    that has none is an error naming it, not a raw safetensors exception."""
    from graphdsl.runtime.loaders.safetensors import tensor_names
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(GraphDSLError, match=r"'.*model.safetensors' is not a readable safetensors file"):
        tensor_names(tmp_path)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 3 + b"garbage")
    with pytest.raises(GraphDSLError, match="not a readable GGUF file"):
        gd.LLM(str(bad), device="cpu")
    with pytest.raises(GraphDSLError, match="missing.gguf' not found"):
        gd.LLM(str(tmp_path / "missing.gguf"), device="cpu")


def test_bad_llm_arguments(ckpt):
    with pytest.raises(GraphDSLError, match="dtype must be one of"):
        gd.LLM(ckpt, device="cpu", dtype="int8")
    with pytest.raises(GraphDSLError, match="max_num_seqs must be a positive int, got 0"):
        gd.LLM(ckpt, device="cpu", max_num_seqs=0)
    with pytest.raises(GraphDSLError, match="max_model_len must be a positive int, got -4"):
        gd.LLM(ckpt, device="cpu", max_model_len=-4)
    with pytest.raises(GraphDSLError, match="max_model_len=4096 exceeds the model's max_position_embeddings=256"):
        gd.LLM(ckpt, device="cpu", max_model_len=4096)
    with pytest.raises(GraphDSLError, match="nothing-here' not found"):
        gd.LLM(str(ckpt / "nothing-here"), device="cpu")


@pytest.mark.parametrize("fraction", [0, 1.5, -0.1, True, "half"])
def test_kv_cache_fraction_is_checked_before_anything_loads(ckpt, fraction, monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before kv_cache_memory_fraction was checked")
    monkeypatch.setattr("graphdsl.entrypoints.llm.load_weights", no_weights)
    with pytest.raises(GraphDSLError, match=r"kv_cache_memory_fraction must be a float in \(0, 1\], got"):
        gd.LLM(ckpt, device="cpu", kv_cache_memory_fraction=fraction)
    with pytest.raises(GraphDSLError, match=r"kv_cache_memory_fraction must be a float in \(0, 1\], got"):
        gd.LLM.from_config({"model_type": "llama"}, device="cpu", kv_cache_memory_fraction=fraction)


def test_bfloat16_and_memory_fraction_cache(ckpt):
    ref = gd.LLM(ckpt, device="cpu", max_model_len=32)
    llm = gd.LLM(ckpt, device="cpu", dtype="bfloat16", kv_cache_memory_fraction=0.001)
    assert llm.kv_cache.key_caches[0].dtype == torch.bfloat16 and llm.blocks.num_blocks >= 1
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a, b = ref.score(ids), llm.score(ids)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()      # bf16 weights: close, not equal
