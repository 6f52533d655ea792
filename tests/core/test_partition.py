"""Device partitioning (graphdsl.passes.partition + runtime.partitioned): a graph labelled with
devices splits into per-device parts with explicit transfer nodes (shown in dumps, no GPU needed);
two CPU parts ("cpu", "cpu:1") run to exactly the unsplit engine's logits, also when a device
comes back (cpu -> cpu:1 -> cpu); weights on the wrong part's device are refused."""
import pytest
import torch

from graphdsl.errors import BindError, GraphDSLError
from graphdsl.passes.partition import partition_by_device
from graphdsl.runtime.partitioned import PartitionedEngine
from tests.helpers import tiny_block


def _split_at(net, *fractions_and_labels):
    """Label node i by the first (fraction, label) whose fraction of the node count exceeds i."""
    n = len(net.nodes)
    index = {node: i for i, node in enumerate(net.nodes)}

    def device_of(node):
        i = index[node]
        return next(label for frac, label in fractions_and_labels if i < frac * n)
    return device_of


def _weights_and_feed():
    w = tiny_block.weights()
    return w, {**w, **tiny_block.inputs(7)}


def test_partition_inserts_transfers_and_dumps_without_gpu(tmp_path):
    net = tiny_block.build()
    part = partition_by_device(net, _split_at(net, (0.5, "cpu"), (1.0, "cuda:0")))
    assert part.devices == ["cpu", "cuda:0"]
    text = str(part.net)
    transfers = [n for n in part.net.nodes if n.op == "transfer"]
    assert transfers and all(n.attrs["device"] == "cuda:0" for n in transfers)
    assert "= transfer(%" in text and "{device=cuda:0}" in text
    assert len(part.net.nodes) == len(net.nodes) + len(transfers)
    part.net.lint()
    for p in part.parts:
        p.net.lint()
    # every tensor part 1 reads from part 0 comes through a transfer
    made0 = {t.name for n in part.parts[0].net.nodes for t in n.outputs}
    assert not made0 & set(part.parts[1].net.inputs)
    assert {t.src for t in part.parts[1].transfers} <= set(part.parts[0].net.outputs)
    summary = str(part)
    assert "part 0 on cpu" in summary and "part 1 on cuda:0" in summary and "transfer(%" in summary
    part.net.dump(tmp_path / "partitioned.json")
    assert '"op": "transfer"' in (tmp_path / "partitioned.json").read_text()


def test_one_device_is_one_part():
    net = tiny_block.build()
    part = partition_by_device(net, lambda node: "cpu")
    assert part.devices == ["cpu"] and not any(n.op == "transfer" for n in part.net.nodes)


@pytest.mark.parametrize("labels", [((0.5, "cpu"), (1.0, "cpu:1")),
                                    ((0.3, "cpu"), (0.7, "cpu:1"), (1.0, "cpu"))])
def test_two_cpu_parts_equal_the_unsplit_engine(labels):
    net = tiny_block.build()
    w, feed = _weights_and_feed()
    want = net.build_engine(device="cpu", backend="torch").forward(dict(feed))["logits"]
    _, feed = _weights_and_feed()          # fresh caches: the engine wrote the first ones
    part = partition_by_device(net, _split_at(net, *labels))
    assert len(part.parts) == len(labels)
    engine = PartitionedEngine(part, device="cpu", backend="torch")
    engine.set_weights(w)
    got = engine.forward({k: v for k, v in feed.items() if k not in w})["logits"]
    assert torch.equal(got, want)
    assert "partition of" in engine.summary()


def test_weight_on_the_wrong_device_is_refused():
    net = tiny_block.build()
    engine = PartitionedEngine(partition_by_device(net, _split_at(net, (0.5, "cpu"), (1.0, "cpu:1"))),
                               device="cpu", backend="torch")
    w, _ = _weights_and_feed()
    bad = {"lm_head": w["lm_head"].to("meta")}
    with pytest.raises(BindError, match=r"weight 'lm_head' is read by part 1 on cpu:1, but it is on meta"):
        engine.set_weights(bad)


def test_empty_network_is_refused():
    from graphdsl import Network
    with pytest.raises(GraphDSLError, match="has no nodes"):
        partition_by_device(Network("empty"), lambda n: "cpu")
