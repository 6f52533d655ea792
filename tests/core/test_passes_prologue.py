"""The ``matmul_prologue`` pass: rms_norm / add_rms_norm / silu_mul feeding a weight matmul become
one op. Each rewrite in fx's test shape (input program, expected program, lint(), numbers of the
engine with the pass equal to the engine without it, bit for bit on the torch backend), the near
misses with their reasons, and the tiny Llama-style block end to end."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError
from graphdsl.passes import PassManager, pass_names
from graphdsl.passes.fused_ops import FUSED_OPS, add_rms_norm_matmul, rms_norm_matmul, silu_mul_matmul

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
import tiny_block  # noqa: E402

PROLOGUE_OPS = ("rms_norm_matmul", "add_rms_norm_matmul", "silu_mul_matmul")


def optimise(net: Network, **kw) -> Network:
    work = Network.from_json(net.to_json())
    PassManager(lint=True, **kw).run(work)
    work.lint()
    return work


def ops_of(net: Network) -> list[str]:
    return [n.op for n in net.nodes]


def run(eng, feed: dict) -> dict:
    return eng.forward({k: v.clone() for k, v in feed.items()})


def assert_pass_keeps_numbers(net: Network, feed: dict):
    """The engine with the pass equals the engine without it, bit for bit (torch backend, CPU),
    and both equal the unoptimised engine."""
    with_pass = net.build_engine(backend="torch")
    without = net.build_engine(backend="torch", disable=["matmul_prologue"])
    plain = net.build_engine(backend="torch", passes=[])
    a, b, c = run(with_pass, feed), run(without, feed), run(plain, feed)
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"output '{k}' differs with the pass"
        torch.testing.assert_close(a[k], c[k], rtol=1e-5, atol=1e-5)
    return with_pass


def fused_count(net: Network) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in ops_of(net):
        if op in PROLOGUE_OPS:
            out[op] = out.get(op, 0) + 1
    return out


# -- each rule fires -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_feeding_a_weight_matmul_becomes_rms_norm_matmul(dtype):
    n = Dim("n")
    # input program
    with Network("p") as net:
        x, g, w = Tensor("x", (n, 32), dtype), Tensor("g", (32,), dtype), Tensor("w", (24, 32), dtype)
        net.mark_output(F.linear(F.rms_norm(x, g, eps=1e-5), w, transpose_b=True), "y")
    # expected program
    with Network("want") as want:
        x, g, w = Tensor("x", (n, 32), dtype), Tensor("g", (32,), dtype), Tensor("w", (24, 32), dtype)
        want.mark_output(rms_norm_matmul(x, g, w, eps=1e-5), "y")

    work = optimise(net)
    assert ops_of(work) == ops_of(want) == ["rms_norm_matmul"]
    node = work.nodes[0]
    assert [t.name for t in node.inputs] == ["x", "g", "w"] and node.attrs == {"eps": 1e-5}
    assert node.outputs[0].dtype == dtype and work.outputs["y"] is node.outputs[0]
    feed = {"x": torch.randn(3, 32).to(dtype), "g": torch.randn(32).to(dtype), "w": torch.randn(24, 32).to(dtype)}
    assert_pass_keeps_numbers(net, feed)
    got = net.build_engine(backend="torch").forward(dict(feed))["y"]
    assert torch.equal(got, want.build_engine(backend="torch", passes=[]).forward(dict(feed))["y"])


def test_add_rms_norm_feeding_a_weight_matmul_returns_product_and_residual():
    n = Dim("n")
    with Network("p") as net:
        x, r = Tensor("x", (n, 32), torch.float32), Tensor("r", (n, 32), torch.float32)
        g, w = Tensor("g", (32,), torch.float32), Tensor("w", (48, 32), torch.float32)
        s = x + r
        net.mark_output(F.linear(F.rms_norm(s, g, eps=1e-6), w, transpose_b=True), "y")
        net.mark_output(s * 0.5, "s_half")              # the new residual has another reader: allowed
    with Network("want") as want:
        x, r = Tensor("x", (n, 32), torch.float32), Tensor("r", (n, 32), torch.float32)
        g, w = Tensor("g", (32,), torch.float32), Tensor("w", (48, 32), torch.float32)
        y, s = add_rms_norm_matmul(x, r, g, w, eps=1e-6)
        want.mark_output(y, "y")
        want.mark_output(s * 0.5, "s_half")

    work = optimise(net, disable=["generic_fusion"])
    assert ops_of(work) == ops_of(want) == ["add_rms_norm_matmul", "scalar", "mul"]
    node = work.nodes[0]
    assert [t.name for t in node.inputs] == ["x", "r", "g", "w"]
    assert [tuple(map(str, t.shape)) for t in node.outputs] == [("n", "48"), ("n", "32")]
    assert work.outputs["y"] is node.outputs[0] and work.nodes[2].inputs[0] is node.outputs[1]
    feed = {"x": torch.randn(5, 32), "r": torch.randn(5, 32), "g": torch.randn(32), "w": torch.randn(48, 32)}
    assert_pass_keeps_numbers(net, feed)


def test_silu_mul_feeding_a_weight_matmul_becomes_silu_mul_matmul():
    n = Dim("n")
    with Network("p") as net:
        gu, w = Tensor("gu", (n, 2 * 24), torch.float32), Tensor("w", (16, 24), torch.float32)
        net.mark_output(F.linear(F.activation(gu, F.ActType.SWIGLU), w, transpose_b=True), "y")
    with Network("want") as want:
        gu, w = Tensor("gu", (n, 2 * 24), torch.float32), Tensor("w", (16, 24), torch.float32)
        want.mark_output(silu_mul_matmul(gu, w), "y")

    work = optimise(net)
    assert ops_of(work) == ops_of(want) == ["silu_mul_matmul"]
    assert [t.name for t in work.nodes[0].inputs] == ["gu", "w"]
    assert Network.from_json(work.to_json()) == work
    assert_pass_keeps_numbers(net, {"gu": torch.randn(4, 48), "w": torch.randn(16, 24)})


def test_llama_block_fuses_every_norm_projection_and_down_projection():
    net = tiny_block.build(2)
    work = optimise(net)
    # layer 0's input norm follows the embedding (rms_norm); every other norm follows a residual
    # add (add_rms_norm): layer 0 post-attention, layer 1 input and post-attention, the final norm
    assert fused_count(work) == {"rms_norm_matmul": 1, "add_rms_norm_matmul": 4, "silu_mul_matmul": 2}
    assert not {"rms_norm", "add_rms_norm", "silu_mul"} & set(ops_of(work))
    left = [n for n in work.nodes if n.op == "matmul"]          # only o_proj reads attention, not a row op
    assert len(left) == 2 and all(n.inputs[0].producer.op == "reshape" for n in left)
    assert [t.name for t in work.outputs["logits"].producer.inputs][2:] == ["final_norm", "lm_head"]

    w, feed = tiny_block.weights(2), tiny_block.inputs(9)
    with_pass = net.build_engine(backend="torch")
    without = net.build_engine(backend="torch", disable=["matmul_prologue"])
    fa, fb = ({**w, **{k: v.clone() for k, v in feed.items()}} for _ in range(2))
    a, b = with_pass.forward(fa)["logits"], without.forward(fb)["logits"]
    assert torch.equal(a, b)
    for cache in ("k_cache0", "v_cache0", "k_cache1", "v_cache1"):
        assert torch.equal(fa[cache], fb[cache])
    torch.testing.assert_close(a, tiny_block.torch_reference(w, feed), rtol=1e-4, atol=1e-4)
    assert with_pass.num_launches == without.num_launches - 7
    rec = {r.name: r.detail for r in with_pass.pass_report.records}
    assert rec["matmul_prologue"] == "rms_norm_matmul x1, add_rms_norm_matmul x4, silu_mul_matmul x2"


# -- near misses -------------------------------------------------------------------------------------
def _norm_then_linear(x_shape, x_dtype, g_dtype, w_shape, w_dtype, transpose_b=True, extra_reader=False):
    with Network("p") as net:
        x, g, w = Tensor("x", x_shape, x_dtype), Tensor("g", (x_shape[-1],), g_dtype), Tensor("w", w_shape, w_dtype)
        h = F.rms_norm(x, g)
        net.mark_output(F.linear(h, w, transpose_b=transpose_b), "y")
        if extra_reader:
            net.mark_output(F.softmax(h, -1), "p")
    feed = {"x": torch.randn(*[3 if isinstance(d, Dim) else d for d in x_shape]).to(x_dtype),
            "g": torch.randn(x_shape[-1]).to(g_dtype), "w": torch.randn(*w_shape).to(w_dtype)}
    return net, feed


_MISSES = {
    "normed_read_twice": (dict(x_shape=(Dim("n"), 32), x_dtype=torch.float32, g_dtype=torch.float32,
                               w_shape=(24, 32), w_dtype=torch.float32, extra_reader=True),
                          "extra user: 'rms_norm_0' (inside the pattern) is also read by 'softmax_"),
    "transpose_b_false": (dict(x_shape=(Dim("n"), 32), x_dtype=torch.float32, g_dtype=torch.float32,
                               w_shape=(32, 24), w_dtype=torch.float32, transpose_b=False),
                          "layout: the matmul has transpose_a=False, transpose_b=False; the prologue fuses "
                          "x @ weightᵀ (transpose_a=False, transpose_b=True) only"),
    "weight_dtype": (dict(x_shape=(Dim("n"), 32), x_dtype=torch.bfloat16, g_dtype=torch.float32,
                          w_shape=(24, 32), w_dtype=torch.float32),
                     "dtype: the weight is torch.float32 but the input torch.bfloat16"),
    "input_3d": (dict(x_shape=(2, Dim("n"), 32), x_dtype=torch.float32, g_dtype=torch.float32,
                      w_shape=(24, 32), w_dtype=torch.float32),
                 "shape: the input [2, n, 32] is not 2-D [tokens, features]"),
    "weight_3d": (dict(x_shape=(Dim("n"), 32), x_dtype=torch.float32, g_dtype=torch.float32,
                       w_shape=(2, 24, 32), w_dtype=torch.float32),
                  "shape: the weight [2, 24, 32] is not 2-D [out, in]"),
}


@pytest.mark.parametrize("case", list(_MISSES))
def test_rms_norm_near_misses_say_why(case):
    kw, reason = _MISSES[case]
    net, feed = _norm_then_linear(**kw)
    eng = assert_pass_keeps_numbers(net, feed)
    assert not set(PROLOGUE_OPS) & set(ops_of(eng.net))
    assert "rms_norm" in ops_of(eng.net) or case == "normed_read_twice"      # (softmax joins a generic group)
    report = eng.fusion_report(rule="rms_norm_matmul")
    assert "rms_norm_matmul: fused 0, near misses 1" in report
    assert reason in report, report
    assert "test_passes_prologue.py" in report                               # names the recording line


def test_add_rms_norm_whose_normed_value_is_read_twice_stays_apart():
    with Network("p") as net:
        x, r = Tensor("x", (4, 32), torch.float32), Tensor("r", (4, 32), torch.float32)
        g, w = Tensor("g", (32,), torch.float32), Tensor("w", (24, 32), torch.float32)
        s = x + r
        h = F.rms_norm(s, g)
        net.mark_output(F.linear(h, w, transpose_b=True), "y")
        net.mark_output(h, "h")                                    # normed is also a network output
        net.mark_output(s, "s")
    eng = assert_pass_keeps_numbers(net, {"x": torch.randn(4, 32), "r": torch.randn(4, 32), "g": torch.randn(32),
                                          "w": torch.randn(24, 32)})
    assert ops_of(eng.net) == ["add_rms_norm", "matmul"]
    report = eng.fusion_report(rule="add_rms_norm_matmul")
    assert "add_rms_norm_matmul: fused 0, near misses 1" in report
    assert "(inside the pattern) is also the network output 'h'" in report


def test_silu_mul_read_twice_stays_apart():
    with Network("p") as net:
        gu, w = Tensor("gu", (4, 48), torch.float32), Tensor("w", (16, 24), torch.float32)
        act = F.activation(gu, F.ActType.SWIGLU)
        net.mark_output(F.linear(act, w, transpose_b=True), "y")
        net.mark_output(act * 2.0, "a2")
    eng = assert_pass_keeps_numbers(net, {"gu": torch.randn(4, 48), "w": torch.randn(16, 24)})
    assert "silu_mul_matmul" not in ops_of(eng.net) and "silu_mul" in ops_of(eng.net)
    assert "extra user: 'silu_mul_" in eng.fusion_report(rule="silu_mul_matmul")


def test_a_matmul_of_the_normed_value_by_itself_stays_apart():
    with Network("p") as net:
        x, g = Tensor("x", (4, 32), torch.float32), Tensor("g", (32,), torch.float32)
        h = F.rms_norm(x, g)
        net.mark_output(F.linear(h, h, transpose_b=True), "gram")
    eng = assert_pass_keeps_numbers(net, {"x": torch.randn(4, 32), "g": torch.randn(32)})
    assert ops_of(eng.net) == ["rms_norm", "matmul"]
    assert "the weight 'rms_norm_0' is the prologue's own result" in eng.fusion_report(rule="rms_norm_matmul")


# -- the pass in the pipeline ------------------------------------------------------------------------
def test_pass_sits_between_epilogue_and_generic_fusion_and_can_be_disabled(monkeypatch):
    names = pass_names()
    assert names.index("matmul_epilogue") + 1 == names.index("matmul_prologue") == names.index("generic_fusion") - 1
    net = tiny_block.build(1)
    eng = net.build_engine(backend="torch", disable=["matmul_prologue"])
    assert not set(PROLOGUE_OPS) & set(ops_of(eng.net))
    report = eng.fusion_report(rule="silu_mul_matmul")
    assert "would fuse, but pass 'matmul_prologue' is disabled" in report
    monkeypatch.setenv("GRAPHDSL_DISABLE_PASSES", "matmul_prologue")
    assert "matmul_prologue" not in PassManager().enabled
    assert not set(PROLOGUE_OPS) & set(ops_of(net.build_engine(backend="torch").net))


def test_fused_ops_are_registered_and_their_shape_errors_read_like_the_members():
    assert set(PROLOGUE_OPS) <= set(FUSED_OPS)
    assert all(FUSED_OPS[name].opdef.category.name == "MATMUL" for name in PROLOGUE_OPS)
    with Network("p"):
        x, w = Tensor("x", (4, 32), torch.float32), Tensor("w", (24, 32), torch.float32)
        with pytest.raises(GraphDSLError, match="rms_norm: weight must be 1-D"):
            rms_norm_matmul(x, Tensor("g2", (4, 32), torch.float32), w)
        with pytest.raises(GraphDSLError, match="matmul: inner dims differ"):
            add_rms_norm_matmul(x, x, Tensor("g", (32,), torch.float32), Tensor("w16", (24, 16), torch.float32))
        with pytest.raises(GraphDSLError, match="silu_mul: last dim must be even"):
            silu_mul_matmul(Tensor("odd", (4, 33), torch.float32), w)
        with pytest.raises(GraphDSLError, match="matmul: operands must share a dtype"):
            silu_mul_matmul(Tensor("gu", (4, 64), torch.float32), Tensor("w16", (24, 32), torch.float16))
