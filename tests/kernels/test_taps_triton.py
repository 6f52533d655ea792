"""Taps on the Triton backend (generated fused kernels; the interpreter on CPU): each tapped tensor
equals the torch reference of the same optimised graph, and the launch count is unchanged."""
import torch

from tests.core.test_taps import _reference
from tests.helpers import tiny_block


def test_triton_taps_equal_reference():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = tiny_block.build(num_layers=1)
    engine = net.build_engine(backend="triton", cache=False)
    w = {k: v.to(device) for k, v in tiny_block.weights(num_layers=1).items()}
    engine.set_weights(w)
    feed = {k: v.to(device) for k, v in tiny_block.inputs(5, num_layers=1).items()}
    launches = engine.num_launches
    plain = engine.forward(dict(feed))["logits"].clone()
    feed = {k: v.to(device) for k, v in tiny_block.inputs(5, num_layers=1).items()}
    out = engine.forward(dict(feed), taps=["op:*"])["logits"]
    assert engine.num_launches == launches
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    fused = [n for n in engine.net.nodes if n.op in ("fused", "add_rms_norm", "matmul_silu_mul", "matmul_add")]
    assert fused, "the graph should hold generated fused kernels"
    ref = _reference(engine, {k: v.to(device) for k, v in tiny_block.inputs(5, num_layers=1).items()})
    assert set(engine.tapped) == {t.name for n in engine.net.nodes for t in n.outputs}
    for name, value in engine.tapped.items():
        torch.testing.assert_close(value, ref[name], rtol=1e-4, atol=1e-4)
