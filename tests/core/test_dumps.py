"""Dumps: text (one line per node), DOT (parses), JSON (round trip), SVG, engine dumps, GRAPHDSL_DUMP_DIR."""
import json
import shutil

import pytest
import torch

from graphdsl import Dim, GraphDSLError, Network, Tensor
from graphdsl import functional as F
from tests.helpers import tiny_block

pydot = pytest.importorskip("pydot")   # a test dependency (make test installs it), absent on bare GPU machines


@pytest.fixture()
def net():
    return tiny_block.build(num_layers=1)


def test_text_has_one_line_per_node(net):
    text = str(net)
    lines = text.splitlines()
    assert lines[0].startswith("network 'tiny_block': ")
    node_lines = [ln for ln in lines if " = " in ln and not ln.strip().startswith("output")]
    assert len(node_lines) == len(net.nodes)
    mm = next(ln for ln in node_lines if "matmul(" in ln)
    assert "{transpose_a=False, transpose_b=True}" in mm and "[num_tokens, 64] float32" in mm
    assert "tiny_block.py:" in mm
    assert "  output logits = %" in text


def test_dot_parses_and_has_every_node(net):
    graphs = pydot.graph_from_dot_data(net.to_dot())
    assert graphs and len(graphs) == 1
    names = {n.get_name().strip('"') for n in graphs[0].get_nodes()}
    assert {n.name for n in net.nodes} <= names
    assert "in:input_ids" in names and "out:logits" in names
    assert len(graphs[0].get_edges()) == sum(len(n.inputs) for n in net.nodes) + len(net.outputs)


def test_json_round_trip_is_equal_and_runs(tmp_path, net):
    path = tmp_path / "g.json"
    net.dump(path)
    back = Network.load(path)
    assert back == net
    assert json.loads(path.read_text())["format"] == "graphdsl.network"
    w, feed = tiny_block.weights(1), tiny_block.inputs(5, num_layers=1)
    a = net.build_engine()
    b = back.build_engine()
    a.set_weights(w)
    b.set_weights(w)
    torch.testing.assert_close(a.forward(dict(feed))["logits"], b.forward(tiny_block.inputs(5, num_layers=1))["logits"])


def test_json_keeps_dims_enums_dtypes_params(tmp_path):
    import graphdsl as gd
    with Network("attrs") as net:
        n = Dim("n", max=32)
        q = Tensor("q", (n, 2, 8), "bfloat16")
        p = gd.Parameter((8,), "bfloat16", shard_dim=0, name="scale")
        a, b = F.rope(q, q, Tensor("c", (n, 4), "float32"), Tensor("s", (n, 4), "float32"), layout=F.RopeLayout.GPTJ)
        net.mark_output(F.cast(a * p, "float32").reshape(n * 2, 8), "o")
    back = Network.from_json(json.loads(json.dumps(net.to_json())))
    assert back == net
    assert back.inputs["scale"].shard_dim == 0 and back.inputs["q"].shape[0].max == 32
    rope = next(x for x in back.nodes if x.op == "rope")
    assert rope.attrs["layout"] is F.RopeLayout.GPTJ


def test_dump_suffixes(tmp_path, net):
    for suffix in (".txt", ".dot", ".json"):
        net.dump(tmp_path / f"g{suffix}")
        assert (tmp_path / f"g{suffix}").stat().st_size > 100
    with pytest.raises(GraphDSLError, match=r"unknown suffix '.png'.*\.txt \.dot \.json \.svg"):
        net.dump(tmp_path / "g.png")
    if shutil.which("dot"):
        net.dump(tmp_path / "g.svg")
        assert (tmp_path / "g.svg").read_text().lstrip().startswith("<")
    else:
        with pytest.raises(GraphDSLError, match="Graphviz 'dot' program.*install"):
            net.dump(tmp_path / "g.svg")


def test_bad_json_is_rejected(tmp_path):
    with pytest.raises(GraphDSLError, match="not a graphdsl network JSON"):
        Network.from_json({"nodes": []})
    with pytest.raises(GraphDSLError, match="version 99 is not supported"):
        Network.from_json({"format": "graphdsl.network", "version": 99})
    with pytest.raises(GraphDSLError, match="load reads .json dumps only"):
        Network.load(tmp_path / "g.txt")


def test_engine_summary_and_dump(tmp_path, net):
    eng = net.build_engine()
    eng.set_weights(tiny_block.weights(1))
    eng.forward(tiny_block.inputs(7, num_layers=1))
    s = eng.summary()
    assert "kernel launches per forward" in s and "[num_tokens=7] arena" in s and "sum of intermediates" in s
    d = eng.dump(tmp_path / "eng")
    for f in ("00-recorded.txt", "graph.txt", "graph.dot", "graph.json", "plan.txt", "summary.txt"):
        assert (d / f).exists(), f
    assert "arena" in (d / "plan.txt").read_text()


def test_dump_dir_env_dumps_every_build(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHDSL_DUMP_DIR", str(tmp_path))
    for _ in range(2):
        with Network("envdump") as net:
            net.mark_output(F.exp(Tensor("x", (2,), "float32")), "y")
        net.build_engine()
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert len(dirs) == 2 and all(d.endswith("-envdump") for d in dirs)
    assert (tmp_path / dirs[0] / "graph.txt").read_text().count("exp(") == 1


def test_dump_and_load_paths_are_checked(tmp_path):
    """Paths that cannot be written or read give GraphDSLErrors naming them, not raw OSErrors."""
    with Network("n") as net:
        net.mark_output(F.exp(Tensor("x", (2,), "float32")), "y")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bad_json = tmp_path / "bad.json"
    engine = net.build_engine()
    for call, msg in [(lambda: engine.dump(a_file), "engine.dump: '.*a_file' is a file, not a folder"),
                      (lambda: net.dump(a_file / "g.txt"), "dump: '.*a_file' is a file, not a folder"),
                      (lambda: net.dump(tmp_path), "dump: unknown suffix ''"),
                      (lambda: net.dump(tmp_path / "dir.txt") or net.dump(tmp_path / "dir.txt" / "x.txt"),
                       "is a file, not a folder"),
                      (lambda: net.build_engine(dump_dir=a_file), "build_engine: dump_dir '.*a_file' .* is a file"),
                      (lambda: Network.load(tmp_path / "none.json"), "load: '.*none.json' not found"),
                      (lambda: (bad_json.write_text("{nope"), Network.load(bad_json)), "is not a JSON graph dump")]:
        with pytest.raises(GraphDSLError, match=msg):
            call()
    (tmp_path / "d.txt").mkdir()
    with pytest.raises(GraphDSLError, match="is a directory; give a file name ending in .txt"):
        net.dump(tmp_path / "d.txt")
