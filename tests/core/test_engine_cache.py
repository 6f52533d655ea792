"""Engine cache: keys change with the graph/options/environment but not with weights; atomic puts;
corrupt entries are dropped; list and clear."""
import json

import pytest

from graphdsl import GraphDSLError, Network, Tensor
from graphdsl import functional as F
from graphdsl.runtime.engine_cache import EngineCache, environment_key


def _graph(k=4):
    with Network("g") as net:
        net.mark_output(F.silu(F.linear(Tensor("x", (2, k), "float32"), Tensor("w", (k, 3), "float32"))), "y")
    return net.to_json()


def test_key_depends_on_graph_options_env_only(tmp_path):
    env = environment_key()
    base = EngineCache.key(_graph(), {"backend": "torch"}, env)
    assert base == EngineCache.key(_graph(), {"backend": "torch"}, env)        # weights are not part of it
    assert base != EngineCache.key(_graph(5), {"backend": "torch"}, env)
    assert base != EngineCache.key(_graph(), {"backend": "triton"}, env)
    assert base != EngineCache.key(_graph(), {"backend": "torch"}, {**env, "torch": "0.0"})
    assert set(env) == {"graphdsl", "torch", "triton", "arch"} and env["arch"] == "cpu"


def test_put_get_list_clear(tmp_path):
    cache = EngineCache(tmp_path / "c")
    key = EngineCache.key(_graph(), {}, environment_key())
    assert cache.get(key) is None
    path = cache.put(key, {"graph": _graph(), "kernels": {"k": "src"}}, name="g")
    assert path.exists() and not list(path.parent.glob(".tmp-*"))
    assert cache.get(key)["kernels"] == {"k": "src"}
    (entry,) = cache.entries()
    assert entry.key == key and entry.name == "g" and entry.size > 0
    assert cache.clear() == 1 and cache.entries() == [] and cache.get(key) is None


def test_corrupt_entry_is_dropped(tmp_path):
    cache = EngineCache(tmp_path)
    key = EngineCache.key(_graph(), {}, environment_key())
    cache.put(key, {"a": 1})
    (tmp_path / f"{key}.json").write_text("{not json")
    assert cache.get(key) is None and not (tmp_path / f"{key}.json").exists()
    other = EngineCache.key(_graph(7), {}, environment_key())
    (tmp_path / f"{other}.json").write_text(json.dumps({"format": 1, "key": key, "payload": {}}))
    assert cache.get(other) is None        # an entry whose key does not match its file is ignored


def test_bad_key_and_default_dir(monkeypatch, tmp_path):
    with pytest.raises(GraphDSLError, match="sha256 hex digest"):
        EngineCache(tmp_path).get("../etc/passwd")
    monkeypatch.setenv("GRAPHDSL_CACHE_DIR", str(tmp_path / "env"))
    assert EngineCache().dir == tmp_path / "env"
