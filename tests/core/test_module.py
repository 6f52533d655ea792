"""Module system: tree, names, parameters with shard specs, module paths on nodes, submodule swap."""
import pytest
import torch

import graphdsl as gd
from graphdsl import GraphDSLError, Network, Tensor
from graphdsl import functional as F


class Lin(gd.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = gd.Parameter((o, i), "float32", shard_dim=0)

    def forward(self, x):
        return F.linear(x, self.weight, transpose_b=True)


class Net(gd.Module):
    def __init__(self):
        super().__init__()
        self.layers = gd.ModuleList([Lin(4, 4) for _ in range(3)])
        self.head = Lin(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def test_named_modules_and_parameters():
    m = Net()
    assert [n for n, _ in m.named_modules()] == ["", "layers", "layers.0", "layers.1", "layers.2", "head"]
    params = dict(m.named_parameters())
    assert list(params) == ["layers.0.weight", "layers.1.weight", "layers.2.weight", "head.weight"]
    assert params["head.weight"].shape == (2, 4) and params["head.weight"].shard_dim == 0
    assert m.get_submodule("layers.1") is m.layers[1]


def test_call_names_params_and_tags_nodes():
    m = Net()
    with Network() as net:
        net.mark_output(m(Tensor("x", (5, 4), "float32")), "y")
    assert sorted(net.parameters) == sorted(n for n, _ in m.named_parameters())
    mods = [n.module for n in net.nodes if n.op == "matmul"]
    assert mods == ["layers.0", "layers.1", "layers.2", "head"]
    eng = net.build_engine()
    ws = {n: torch.randn(p.shape) for n, p in m.named_parameters()}
    eng.set_weights(ws)
    x = torch.randn(5, 4)
    ref = x
    for i in range(3):
        ref = torch.relu(ref @ ws[f"layers.{i}.weight"].T)
    torch.testing.assert_close(eng.forward({"x": x})["y"], ref @ ws["head.weight"].T)


def test_set_submodule_swaps_before_recording():
    class Doubler(gd.Module):
        def forward(self, x):
            return x * 2.0

    m = Net()
    m.set_submodule("layers.1", Doubler())
    m.set_submodule("head", Doubler())
    with Network() as net:
        net.mark_output(m(Tensor("x", (5, 4), "float32")), "y")
    assert [n.module for n in net.nodes if n.op == "mul"] == ["layers.1", "head"]
    with pytest.raises(GraphDSLError, match="no submodule 'layers.nope' to replace"):
        m.set_submodule("layers.nope", Doubler())
    with pytest.raises(GraphDSLError, match=r"ModuleList has no submodule 'x' \(in path 'layers.x.y'\)"):
        m.get_submodule("layers.x.y")


def test_module_errors():
    class Forgot(gd.Module):
        def __init__(self):
            self.x = 1

    with pytest.raises(GraphDSLError, match=r"call super\(\).__init__\(\)"):
        Forgot()
    with pytest.raises(GraphDSLError, match="ModuleList holds Modules"):
        gd.ModuleList([1])
    with pytest.raises(GraphDSLError, match="shard_dim must be a dim of shape"):
        gd.Parameter((2, 3), shard_dim=2)
    with pytest.raises(NotImplementedError, match="must define forward"):
        gd.Module()(Tensor("x"))
