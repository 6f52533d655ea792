"""Taps: intermediate tensors copied out of a fused engine equal the torch reference of the same
graph, and tapping changes neither the kernel count nor the outputs."""
import pytest
import torch

import graphdsl as gd
from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F
from graphdsl.errors import BindError
from graphdsl.runtime.backends import TorchBackend
from tests.helpers import tiny_block


class _MLP(gd.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.norm = gd.Parameter((hidden,), "float32")
        self.gate_up = gd.Parameter((2 * inter, hidden), "float32")
        self.down = gd.Parameter((hidden, inter), "float32")

    def forward(self, x):
        h = F.rms_norm(x, self.norm, eps=1e-6)
        h = F.activation(F.linear(h, self.gate_up, transpose_b=True), F.ActType.SWIGLU)
        return x + F.linear(h, self.down, transpose_b=True)


class _Model(gd.Module):
    def __init__(self):
        super().__init__()
        self.layers = gd.ModuleList([_MLP(8, 16) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _mlp_engine(**kw):
    with Network("taps") as net:
        model = _Model()
        net.mark_output(model(Tensor("x", (Dim("n", max=64), 8), "float32")), "y")
    engine = net.build_engine(**kw)
    g = torch.Generator().manual_seed(0)
    engine.set_weights({name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()})
    return engine


def _reference(engine, inputs: dict) -> dict:
    """Every tensor of the engine's own (optimised) graph, computed by the ops' torch references."""
    values = {t: v for name, t in engine.net.inputs.items() for v in [{**engine._weights, **inputs}.get(name)]
              if v is not None}
    attrs = {n: n.attrs for n in engine.net.nodes}
    TorchBackend().run(engine.net.nodes, values, attrs, {})
    return {t.name: v for t, v in values.items()}


def test_module_taps_equal_reference_and_keep_the_schedule():
    engine = _mlp_engine()
    x = torch.randn(5, 8)
    plain = engine.forward({"x": x})["y"]
    launches = engine.num_launches
    out = engine.forward({"x": x}, taps="layers.0")["y"]
    assert engine.num_launches == launches
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    ref = _reference(engine, {"x": x})
    produced = {t.name for n in engine.net.nodes if n.module == "layers.0" for t in n.outputs}
    assert set(engine.tapped) == produced and produced
    for name, value in engine.tapped.items():
        torch.testing.assert_close(value, ref[name])


def test_taps_survive_arena_reuse():
    """A slot written again later in the step still gives the value as the node wrote it."""
    engine = _mlp_engine()
    x = torch.randn(7, 8)
    engine.forward({"x": x}, taps=["op:*"])
    ref = _reference(engine, {"x": x})
    shared = [names for names in _slot_sharers(engine) if len(names) > 1]
    assert shared, "the plan lets no tensors share bytes; the test needs one that does"
    assert set(engine.tapped) == {t.name for n in engine.net.nodes for t in n.outputs}
    for name, value in engine.tapped.items():
        torch.testing.assert_close(value, ref[name])


def _slot_sharers(engine):
    by_range: dict = {}
    for name, rng in engine.last_plan.memory.slots.items():
        by_range.setdefault(rng[0], []).append(name)
    return by_range.values()


def test_selectors_op_and_glob_and_env(monkeypatch):
    engine = _mlp_engine()
    x = torch.randn(3, 8)
    engine.forward({"x": x}, taps="op:matmul_silu_mul")
    assert sorted(engine.tapped) == sorted(t.name for n in engine.net.nodes if n.op == "matmul_silu_mul"
                                           for t in n.outputs)
    assert len(engine.tapped) == 2
    engine.forward({"x": x}, taps="module:layers.*")
    assert len(engine.tapped) == sum(len(n.outputs) for n in engine.net.nodes if n.module)
    engine.tapped = {}
    monkeypatch.setenv("GRAPHDSL_TAPS", "x, op:add_rms_norm")
    engine.forward({"x": x})
    assert set(engine.tapped) == {"x"} | {t.name for n in engine.net.nodes if n.op == "add_rms_norm"
                                          for t in n.outputs}
    torch.testing.assert_close(engine.tapped["x"], x)


def test_tap_errors_name_the_fused_kernel():
    engine = _mlp_engine()
    x = torch.randn(3, 8)
    with pytest.raises(BindError, match=r"'silu_3' was fused into kernel 'matmul_silu_mul_\d+'"):
        engine.forward({"x": x}, taps="silu_3")
    with pytest.raises(BindError, match="names no tensor, node, module or op"):
        engine.forward({"x": x}, taps="layers.7")
    unfused = _mlp_engine(passes=[])                      # every op kept apart: silu_3 has a slot
    unfused.forward({"x": x}, taps="silu_3")
    h = torch.nn.functional.rms_norm(x, (8,), unfused._weights["layers.0.norm"], eps=1e-6)
    gate = (h @ unfused._weights["layers.0.gate_up"].T)[:, :16]
    torch.testing.assert_close(unfused.tapped["silu_3"], torch.nn.functional.silu(gate))


def test_tap_buffers_are_filled_in_place():
    engine = _mlp_engine()
    x = torch.randn(4, 8)
    engine.forward({"x": x}, taps="op:matmul_silu_mul")
    bufs = {k: torch.zeros_like(v) for k, v in engine.tapped.items()}
    engine.forward({"x": x}, taps=bufs)
    for k, v in bufs.items():
        assert engine.tapped[k] is v
        assert v.abs().sum() > 0
    with pytest.raises(BindError, match="tap buffer"):
        engine.forward({"x": x}, taps={k: torch.zeros(1) for k in bufs})


def test_tiny_decoder_taps_match_reference_with_attention_and_cache():
    net = tiny_block.build()
    engine = net.build_engine()
    engine.set_weights(tiny_block.weights())
    feed = tiny_block.inputs(6)
    launches = engine.num_launches
    engine.forward(dict(feed), taps="op:*attention*")
    assert engine.num_launches == launches and engine.tapped
    fresh = tiny_block.inputs(6)
    ref = _reference(engine, fresh)
    for name, value in engine.tapped.items():
        torch.testing.assert_close(value, ref[name])
