"""build_engine with the on-disk engine cache: a second build is a hit that skips the passes and
computes the same; other options miss; changed weights reuse the entry; a corrupt entry is rebuilt;
``graphdsl cache list|clear``."""
import json

import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.entrypoints.cli import main
from graphdsl.runtime.engine_cache import EngineCache
from tests.helpers import tiny_block


def _stages(engine):
    return {name: info for name, _, info in engine.build_report}


def _run(engine, seed=0):
    engine.set_weights(tiny_block.weights(2, seed=seed))
    return engine.forward({k: v.clone() for k, v in tiny_block.inputs(7).items()})["logits"]


def test_second_build_is_a_hit_with_equal_results(tmp_path):
    cache = EngineCache(tmp_path)
    cold = tiny_block.build(2).build_engine(backend="torch", cache=cache)
    assert _stages(cold)["cache lookup"] == "cache miss" and "passes" in _stages(cold)
    assert len(cache.entries()) == 1 and cache.entries()[0].name == cold.recorded.name
    warm = tiny_block.build(2).build_engine(backend="torch", cache=cache)
    st = _stages(warm)
    assert st["cache lookup"] == "cache hit" and "passes" not in st and "cache lookup" in warm.summary()
    assert warm.cache_key == cold.cache_key and len(cache.entries()) == 1
    assert [n.op for n in warm.net.nodes] == [n.op for n in cold.net.nodes]
    assert warm.fold_constants == cold.fold_constants and str(warm.pass_report) == str(cold.pass_report)
    torch.testing.assert_close(_run(warm), _run(cold), rtol=0, atol=0)
    # weights are bound, not baked: other weights reuse the entry and still compute their own result
    again = tiny_block.build(2).build_engine(backend="torch", cache=cache)
    assert _stages(again)["cache lookup"] == "cache hit"
    assert not torch.equal(_run(again, seed=5), _run(cold))
    torch.testing.assert_close(_run(again, seed=5), _run(tiny_block.build(2).build_engine(backend="torch",
                                                                                           cache=False), seed=5))


def test_other_options_or_graph_miss(tmp_path):
    cache = EngineCache(tmp_path)
    tiny_block.build(2).build_engine(backend="torch", cache=cache)
    for kw in ({"disable": ["generic_fusion"]}, {"passes": []}, {"backend": "triton"}):
        eng = tiny_block.build(2).build_engine(**{"backend": "torch", **kw}, cache=cache)
        assert _stages(eng)["cache lookup"] == "cache miss", kw
    eng = tiny_block.build(1).build_engine(backend="torch", cache=cache)
    assert _stages(eng)["cache lookup"] == "cache miss"
    assert len(cache.entries()) == 5


def test_env_disable_passes_is_part_of_the_key(tmp_path, monkeypatch):
    cache = EngineCache(tmp_path)
    a = tiny_block.build(2).build_engine(backend="torch", cache=cache)
    monkeypatch.setenv("GRAPHDSL_DISABLE_PASSES", "generic_fusion")
    b = tiny_block.build(2).build_engine(backend="torch", cache=cache)
    assert a.cache_key != b.cache_key and _stages(b)["cache lookup"] == "cache miss"


@pytest.mark.parametrize("corruption", ["not json", "bad payload", "bad graph"])
def test_corrupt_entry_is_rebuilt(tmp_path, corruption):
    cache = EngineCache(tmp_path)
    cold = tiny_block.build(2).build_engine(backend="torch", cache=cache)
    path = tmp_path / f"{cold.cache_key}.json"
    obj = json.loads(path.read_text())
    if corruption == "not json":
        path.write_text("{truncated")
    elif corruption == "bad payload":
        obj["payload"].pop("fold_constants")
        path.write_text(json.dumps(obj))
    else:
        obj["payload"]["net"]["nodes"][3]["inputs"] = ["no_such_tensor"]
        path.write_text(json.dumps(obj))
    eng = tiny_block.build(2).build_engine(backend="torch", cache=cache)
    assert _stages(eng)["cache lookup"] == "cache miss" and "passes" in _stages(eng)
    torch.testing.assert_close(_run(eng), _run(cold), rtol=0, atol=0)
    assert _stages(tiny_block.build(2).build_engine(backend="torch", cache=cache))["cache lookup"] == "cache hit"


def test_default_is_off_on_cpu_and_env_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHDSL_CACHE_DIR", str(tmp_path))
    eng = tiny_block.build(2).build_engine(backend="torch")
    assert "cache lookup" not in _stages(eng) and eng.cache_key is None
    eng = tiny_block.build(2).build_engine(backend="torch", cache=True)
    assert _stages(eng)["cache lookup"] == "cache miss" and len(EngineCache().entries()) == 1
    monkeypatch.setenv("GRAPHDSL_ENGINE_CACHE", "0")
    assert "cache lookup" not in _stages(tiny_block.build(2).build_engine(backend="torch", cache=True))
    with pytest.raises(GraphDSLError, match="cache must be None, True, False or an EngineCache, got 'yes'"):
        tiny_block.build(2).build_engine(backend="torch", cache="yes")


def test_dumping_runs_the_passes_even_on_a_hit(tmp_path):
    cache = EngineCache(tmp_path / "c")
    tiny_block.build(2).build_engine(backend="torch", cache=cache)
    eng = tiny_block.build(2).build_engine(backend="torch", cache=cache, dump_dir=tmp_path / "d")
    assert "passes" in _stages(eng) and "cache lookup" not in _stages(eng)


def test_cli_cache_list_and_clear(tmp_path, capsys):
    cache = EngineCache(tmp_path)
    tiny_block.build(2).build_engine(backend="torch", cache=cache)
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (entry,) = cache.entries()
    assert "1 entries" in out and entry.key[:12] in out and entry.name in out
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and cache.entries() == []
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0 and "0 entries" in capsys.readouterr().out
