"""runtime/loaders/safetensors.py: safetensors iteration (single, sharded, dtype) and its error paths."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.loaders.safetensors import WeightReport, check_weights, iter_safetensors

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_matches_hf_state_dict(tmp_path, shard):
    model = _tiny_llama()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    else:
        assert (tmp_path / "model.safetensors").exists()
    got = dict(iter_safetensors(tmp_path))
    want = model.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)


def test_single_file_and_dtype_converts_floats_only(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(3, 4), "ids": torch.arange(5, dtype=torch.int64)}, str(f))
    out = dict(iter_safetensors(f, dtype=torch.bfloat16))
    assert out["a"].dtype == torch.bfloat16
    assert out["ids"].dtype == torch.int64
    assert out["ids"].tolist() == [0, 1, 2, 3, 4]


def test_is_lazy_one_tensor_at_a_time(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file({f"t{i}": torch.full((2,), float(i)) for i in range(4)}, str(f))
    it = iter_safetensors(f)
    name, t = next(it)
    assert name.startswith("t") and t.shape == (2,)


def test_missing_path(tmp_path):
    with pytest.raises(GraphDSLError, match="does not exist"):
        list(iter_safetensors(tmp_path / "nope"))


def test_wrong_extension(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x")
    with pytest.raises(GraphDSLError, match=r"must be a \.safetensors file"):
        list(iter_safetensors(f))


def test_empty_dir_names_expected_files(tmp_path):
    with pytest.raises(GraphDSLError, match="neither 'model.safetensors' nor"):
        list(iter_safetensors(tmp_path))


def test_dir_with_other_safetensors_lists_them(tmp_path):
    save_file({"a": torch.zeros(1)}, str(tmp_path / "adapter.safetensors"))
    with pytest.raises(GraphDSLError, match=r"adapter\.safetensors"):
        list(iter_safetensors(tmp_path))


def test_not_safetensors(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"this is not a safetensors file at all" * 10)
    with pytest.raises(GraphDSLError, match=r"model\.safetensors.*not a readable safetensors"):
        list(iter_safetensors(f))


def test_truncated(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64, 64)}, str(f))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(GraphDSLError, match=r"model\.safetensors"):
        list(iter_safetensors(tmp_path))


def test_empty_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(GraphDSLError, match="not a readable safetensors"):
        list(iter_safetensors(f))


def test_bad_dtype_argument(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(1)}, str(f))
    with pytest.raises(GraphDSLError, match="dtype must be a torch.dtype.*'bf16'"):
        list(iter_safetensors(f, dtype="bf16"))


def test_index_missing_shard(tmp_path):
    idx = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(GraphDSLError, match=r"names shard 'model-00001-of-00002\.safetensors'.*'a'"):
        list(iter_safetensors(tmp_path))


def test_index_tensor_not_in_shard(tmp_path):
    save_file({"a": torch.zeros(1)}, str(tmp_path / "s1.safetensors"))
    idx = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(GraphDSLError, match=r"s1\.safetensors.*lacks 1 tensors.*\['b'\]"):
        list(iter_safetensors(tmp_path))


def test_index_bad_json(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(GraphDSLError, match="cannot read safetensors index"):
        list(iter_safetensors(tmp_path))


def test_index_without_weight_map(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(GraphDSLError, match="must hold a 'weight_map'"):
        list(iter_safetensors(tmp_path))


def test_check_weights_ok():
    check_weights({"a": (2, 3)}, {"a": (2, 3)})


def test_check_weights_lists_everything_in_one_error():
    expected = {"w.q": (4, 4), "w.k": (2, 4), "norm": (4,)}
    got = {"w.q": (4, 4), "w.k": (4, 4), "extra.bias": (7,)}
    with pytest.raises(GraphDSLError) as ei:
        check_weights(expected, got)
    msg = str(ei.value)
    assert "1 missing" in msg and "norm: expected shape [4]" in msg
    assert "1 unexpected" in msg and "extra.bias: shape [7]" in msg
    assert "1 with wrong shape" in msg and "w.k: expected shape [2, 4], got [4, 4]" in msg
    assert "w.q" not in msg


def test_weight_report_fields():
    r = WeightReport.compare({"a": (1,), "b": (2,)}, {"b": (3,), "c": (1,)})
    assert r.missing == [("a", (1,))]
    assert r.unexpected == [("c", (1,))]
    assert r.wrong_shape == [("b", (2,), (3,))]
    assert not r.ok
    assert WeightReport.compare({"a": (1,)}, {"a": (1,)}).ok
