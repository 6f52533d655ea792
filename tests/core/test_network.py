"""Recording: default/contextual networks, inputs, outputs, module paths, source lines, lint."""
import threading

import networkx as nx
import pytest
import torch

import graphdsl as gd
from graphdsl import Dim, GraphDSLError, Network, ShapeError, Tensor, get_default_net
from graphdsl import functional as F


def test_default_net_is_thread_local_and_reset_after_build():
    net = get_default_net()
    out = F.add(Tensor("a"), Tensor("b"))
    net.mark_output(out, "c")
    seen = []
    t = threading.Thread(target=lambda: seen.append(get_default_net()))
    t.start(); t.join()
    assert seen[0] is not net
    net.build_engine()
    assert get_default_net() is not net and not get_default_net().nodes


def test_with_network_records_into_it_and_not_default():
    before = len(get_default_net().nodes)
    with Network("mine") as net:
        F.exp(Tensor("x", (4,), "float32"))
    assert len(net.nodes) == 1 and len(get_default_net().nodes) == before


def test_inputs_inferred_and_merged_by_name():
    with Network() as net:
        x1, x2 = Tensor("x", (3,), "float32"), Tensor("x", (3,), "float32")
        y = x1 + x2
        net.mark_output(y, "y")
    assert list(net.inputs) == ["x"]
    with Network() as net:
        with pytest.raises(GraphDSLError, match="two different inputs are named 'x'"):
            Tensor("x", (3,), "float32") + Tensor("x", (3,), "float16")


def test_mixing_networks_is_an_error():
    with Network("first"):
        a = F.exp(Tensor("x", (2,), "float32"))
    with Network("second"):
        with pytest.raises(GraphDSLError, match="recorded in network 'first' but the current network is 'second'"):
            F.exp(a)


def test_node_keeps_source_line_and_module_path():
    class Inner(gd.Module):
        def forward(self, x):
            return F.silu(x)

    class Outer(gd.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) * 2.0

    with Network() as net:
        Outer()(Tensor("x", (2,), "float32"))
    silu = next(n for n in net.nodes if n.op == "silu")
    mul = next(n for n in net.nodes if n.op == "mul")
    assert silu.module == "inner" and mul.module == "Outer"
    assert silu.source.endswith(f"test_network.py:{Inner.forward.__code__.co_firstlineno + 1}")


def test_data_dependent_control_flow_errors_name_the_line():
    x = Tensor("x", (2,), "float32")
    with Network():
        y = F.exp(x)
        for what, fn in [("bool", lambda: bool(y)), (".item", lambda: y.item()), ("int", lambda: int(y)),
                         ("iterating", lambda: list(y)), ("bool", lambda: (y > 0) and 1)]:
            with pytest.raises(GraphDSLError, match=rf"{what}.*test_network.py:\d+.*no data"):
                fn()


def test_len_only_for_static_first_dim():
    assert len(Tensor("x", (3, 2))) == 3
    with pytest.raises(GraphDSLError, match="len"):
        len(Tensor("x", (Dim("n"), 2)))


def test_shape_errors_name_op_and_source():
    with Network():
        with pytest.raises(ShapeError, match=r"matmul: inner dims differ: \[3, 4\] @ \[5, 6\].*test_network.py"):
            F.matmul(Tensor("a", (3, 4), "float32"), Tensor("b", (5, 6), "float32"))


def test_bad_arguments_are_clear():
    with Network():
        with pytest.raises(GraphDSLError, match="argument 'x' must be a graphdsl Tensor, got Tensor"):
            F.exp(torch.ones(2))
        with pytest.raises(GraphDSLError, match="unexpected argument 'bogus'"):
            F.softmax(Tensor("x", (2,), "float32"), bogus=1)
    with pytest.raises(GraphDSLError, match="non-empty string name"):
        Tensor("")
    with pytest.raises(GraphDSLError, match="one of"):
        Tensor("x", (2,), "float99")
    with pytest.raises(GraphDSLError, match="mark_output expects a graphdsl Tensor"):
        Network().mark_output(torch.ones(1), "o")


def test_networkx_view():
    with Network() as net:
        x = Tensor("x", (4,), "float32")
        y = F.exp(x) + x
        net.mark_output(y, "y")
    g = net.to_networkx()
    assert isinstance(g, nx.MultiDiGraph)
    assert nx.is_directed_acyclic_graph(g)
    assert g.nodes["input:x"]["kind"] == "input" and g.nodes["output:y"]["kind"] == "output"
    assert g.number_of_edges("input:x", "add_1") == 1 and g.number_of_edges("exp_0", "add_1") == 1


def test_lint_reports_every_problem():
    with Network() as net:
        x = Tensor("x", (4,), "float32")
        a = F.exp(x)
        b = F.neg(a)
        net.mark_output(b, "b")
    net.lint()
    net.nodes.reverse()                       # neg now reads exp's output before it is produced
    net.nodes[1].outputs[0].shape = (5,)      # and exp's output lies about its shape
    with pytest.raises(GraphDSLError) as e:
        net.lint()
    msg = str(e.value)
    assert "node 'neg_1' reads 'exp_0', produced by a later node" in msg
    assert "output 'exp_0' is [5] float32 but its rule gives [4] float32" in msg


def test_register_user_op_in_python():
    @gd.register_op("test_swish", category=gd.OpCategory.POINTWISE, shape=gd.same_as(0))
    def swish(x, *, beta: float = 1.0):
        """swish(x) = x * sigmoid(beta x)"""
        return x * torch.sigmoid(beta * x)

    with Network() as net:
        net.mark_output(swish(Tensor("x", (5,), "float32"), beta=2.0), "y")
    assert gd.opdef.get_op("test_swish").doc.startswith("swish(x)")
    x = torch.randn(5)
    torch.testing.assert_close(net.build_engine().forward({"x": x})["y"], x * torch.sigmoid(2 * x))
    with pytest.raises(GraphDSLError, match="already registered"):
        gd.register_op("test_swish", category=gd.OpCategory.POINTWISE, shape=gd.same_as(0))(lambda x: x)
    with pytest.raises(GraphDSLError, match="category must be an OpCategory"):
        gd.register_op("bad", category="pointwise", shape=gd.same_as(0))
