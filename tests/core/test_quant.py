"""Quantization schemes on Parameters: round trips, ``F.linear`` dispatch to ``quant_linear``, the
CPU engine against dequantize-then-matmul, printing/dumps, and errors naming tensor and scheme."""
import pytest
import torch

from graphdsl import Network, Parameter, Tensor
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError
from graphdsl.quant import IntScheme, online_scheme, pack_int4, parse_scheme, unpack_int4

SCHEMES = ["int4-g32", "int4-g64-zp", "int4-g128", "int8-channel", "fp8-tensor", "fp8-channel", "fp8-channel-dyn"]
# worst |W - dequant(quant(W))| relative to max|W| per scheme
TOL = {"int4": 0.15, "int8": 0.01, "fp8": 0.07}


@pytest.mark.parametrize("name", SCHEMES)
def test_round_trip(name):
    s = parse_scheme(name)
    assert s.name == name and parse_scheme(s.name) is s
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    stored = s.quantize(w)
    assert [tuple(t.shape) for t in stored] == [c.shape for c in s.companions(48, 256)]
    back = s.dequantize(stored, 48, 256, torch.float32)
    assert (back - w).abs().max() / w.abs().max() < TOL[name.split("-")[0]]


def test_pack_int4_inverse():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    p = pack_int4(q)
    assert p.shape == (5, 32) and torch.equal(p[:, 0] & 15, q[:, 0]) and torch.equal(p[:, 0] >> 4, q[:, 1])
    assert torch.equal(unpack_int4(p), q)


@pytest.mark.parametrize("name", SCHEMES)
def test_linear_dispatch_and_engine(name, tmp_path):
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    b = torch.randn(40)
    with Network("q") as net:
        p = Parameter((40, 128), torch.float32, name="proj.weight").quantize(name)
        bias = Parameter((40,), torch.float32, name="proj.bias")
        net.mark_output(F.linear(Tensor("x", (3, 128), torch.float32), p, bias, transpose_b=True), "y")
    text = str(net)
    assert f"quant_linear(%x, %proj.weight" in text and f"scheme={name}" in text
    assert "matmul" not in text
    net.dump(tmp_path / "g.json")
    assert Network.load(tmp_path / "g.json") == net
    s = parse_scheme(name)
    stored = s.quantize(w)
    x = torch.randn(3, 128)
    feed = {"x": x, "proj.bias": b, **{c.name: t for c, t in zip(p.companions(), stored)}}
    y = net.build_engine(device="cpu", backend="torch").forward(feed)["y"]
    wd = s.dequantize(stored, 40, 128, torch.float32)
    if s.name.endswith("-dyn"):
        xs = x.abs().amax(-1, keepdim=True) / 448
        x = (x / xs).to(torch.float8_e4m3fn).float() * xs
    torch.testing.assert_close(y, x @ wd.T + b, atol=1e-4, rtol=1e-4)


def test_parameter_repr_and_companion_names():
    p = Parameter((16, 64), name="a.weight").quantize("int4-g32-zp")
    assert "quant=int4-g32-zp" in repr(p)
    assert [c.name for c in p.companions()] == ["a.weight_packed", "a.weight_scale", "a.weight_zero_point"]
    p.name = "b.weight"
    assert p.companions()[0].name == "b.weight_packed"
    assert p.quantize(None).companions() == []


def test_errors_name_tensor_and_scheme():
    with pytest.raises(GraphDSLError, match=r"unknown quantization scheme 'int3-g8'.*families"):
        parse_scheme("int3-g8")
    with pytest.raises(GraphDSLError, match=r"int4-g128.*'l.weight' has 96 inputs.*group size 128"):
        Parameter((8, 96), name="l.weight").quantize("int4-g128")
    with pytest.raises(GraphDSLError, match="group_size must be one of"):
        IntScheme(4, 48)
    with pytest.raises(GraphDSLError, match=r"act_order applies to int4 weights, got bits=8"):
        IntScheme(8, None, False, True)
    with pytest.raises(GraphDSLError, match=r"quantization must be one of \['fp8', 'int8', 'int4', 'gguf'\].*'nf4'"):
        online_scheme("nf4")
    # the parser's own reason is kept, a name in the wrong case gets its lower-case spelling, and
    # the schemes online quantization cannot make (act-order, the CUDA block layout) are refused early
    with pytest.raises(GraphDSLError, match=r"got 'int4-g16' \(int4 group_size must be one of \[32, 64, 128\], got 16"):
        online_scheme("int4-g16")
    with pytest.raises(GraphDSLError, match=r"did you mean 'int4-g64-zp'\?"):
        online_scheme("INT4-g64-ZP")
    # 'gguf' names no scheme yet is a valid value, and stray spaces are a typo too
    with pytest.raises(GraphDSLError, match=r"got 'GGUF' .*; did you mean 'gguf'\?"):
        online_scheme("GGUF")
    with pytest.raises(GraphDSLError, match=r"got 'int4 ' .*; did you mean 'int4'\?"):
        online_scheme("int4 ")
    import graphdsl.runtime  # noqa: F401 - registers the gguf-<type> schemes
    with pytest.raises(GraphDSLError, match=r"quantization='gguf-q4_k-kb': -kb is the layout graphdsl stores int4 "
                                            r"codes and GGUF blocks in"):
        online_scheme("gguf-q4_k-kb")
    with pytest.raises(GraphDSLError, match=r"quantization='int4-g64-act': act-order schemes .* GPTQ checkpoint"):
        online_scheme("int4-g64-act")
    with pytest.raises(GraphDSLError, match=r"quantization='int4-g128-kb': -kb is the layout"):
        online_scheme("int4-g128-kb")
    s = parse_scheme("int4-g32")
    bad = {"l.weight_packed": torch.zeros(8, 64, dtype=torch.uint8), "l.weight_scale": torch.zeros(8, 3)}
    with pytest.raises(GraphDSLError, match=r"'l.weight' \(int4-g32\): tensor 'l.weight_packed' should be \[8, 32\]"):
        s.check_tensors("l.weight", bad, 8, 64)
    with pytest.raises(GraphDSLError, match=r"tensor 'l.weight_scale' is missing"):
        s.check_tensors("l.weight", {"l.weight_packed": torch.zeros(8, 32, dtype=torch.uint8)}, 8, 64)


def test_fusion_report_shows_scheme():
    with Network("q") as net:
        p = Parameter((16, 64), torch.float32, name="proj.weight").quantize("int8-channel")
        net.mark_output(F.linear(Tensor("x", (2, 64), torch.float32), p, None, transpose_b=True), "y")
    report = net.build_engine(device="cpu").fusion_report()
    assert "int8-channel x1" in report


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_act_order_gathers_the_inputs_then_runs_the_plain_scheme(backend):
    """``int4-g32-zp-act``: W[:, perm] holds the groups; the graph gathers x[..., perm] and runs
    ``quant_linear`` in ``int4-g32-zp`` on the other companions; the engine equals x @ W.T."""
    s = parse_scheme("int4-g32-zp-act")
    assert s.name == "int4-g32-zp-act" and s.kernel_scheme.name == "int4-g32-zp" and s.permutes_input
    assert [c.suffix for c in s.companions(40, 128)][-1] == "_perm"
    with pytest.raises(GraphDSLError, match=r"'int4-g32-zp-act' cannot quantize a weight online"):
        s.quantize(torch.randn(40, 128))
    with Network("q") as net:
        p = Parameter((40, 128), torch.float32, name="proj.weight").quantize(s)
        net.mark_output(F.linear(Tensor("x", (3, 128), torch.float32), p, None, transpose_b=True), "y")
    text = str(net)
    assert "gather(%x, %proj.weight_perm)" in text and "scheme=int4-g32-zp," in text
    g = torch.Generator().manual_seed(4)
    perm = torch.randperm(128, generator=g).to(torch.int32)
    stored = s.kernel_scheme.quantize(torch.randn(40, 128, generator=g)) + [perm]
    w = s.dequantize(stored, 40, 128, torch.float32)
    torch.testing.assert_close(w[:, perm.long()], s.kernel_scheme.dequantize(stored[:-1], 40, 128, torch.float32))
    x = torch.randn(3, 128, generator=g)
    feed = {"x": x, **{c.name: t for c, t in zip(p.companions(), stored)}}
    y = net.build_engine(device="cpu", backend=backend).forward(feed)["y"]
    torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s.linear(x, stored, 40, 128), x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [256, 192, 576])
def test_int4_blocks_round_trip_and_the_blocked_schemes(k):
    """``int4_blocks`` puts byte ``j`` of row ``r`` at ``[j // 64, r, j % 64]`` (a short last block
    zero-padded) and ``int4_unblocks`` undoes it; a ``-kb`` scheme stores its codes so, reads the
    same weight back and multiplies to the same values; the suffix parses and prints after the
    others, and only int4 takes it."""
    from graphdsl.quant import int4_blocks, int4_unblocks
    packed = torch.randint(0, 256, (40, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
    blocks = int4_blocks(packed)
    assert tuple(blocks.shape) == (-(-k // 128), 40, 64)
    assert blocks[1, 7, 3] == packed[7, 67] and torch.equal(int4_unblocks(blocks, k), packed)
    assert int4_unblocks(blocks, k).is_contiguous()       # the kernels read rows of it
    if k % 128:
        assert not blocks[-1, :, (k // 2) % 64:].any()
    rows, kb = parse_scheme("int4-g64-zp"), parse_scheme("int4-g64-zp-kb")
    assert kb == rows.with_blocks() and kb.name == "int4-g64-zp-kb" and kb.with_blocks(False) == rows
    assert parse_scheme("int4-g32-act-kb").kernel_scheme.name == "int4-g32-kb"
    w = torch.randn(40, k)
    a, b = rows.quantize(w), kb.quantize(w)
    assert torch.equal(b[0], int4_blocks(a[0])) and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
    assert torch.equal(kb.dequantize(b, 40, k, torch.float32), rows.dequantize(a, 40, k, torch.float32))
    x = torch.randn(3, k)
    assert torch.equal(kb.linear(x, b, 40, k), rows.linear(x, a, 40, k))
    with pytest.raises(GraphDSLError, match=r"tensor 'w_packed' should be \[\d, 40, 64\] torch.uint8, got \[40, "):
        kb.check_tensors("w", {"w_packed": a[0], "w_scale": a[1], "w_zero_point": a[2]}, 40, k)
    with pytest.raises(GraphDSLError, match=r"int4_unblocks: blocks must be \[\d, out, 64\] for"):
        int4_unblocks(packed, k)
    with pytest.raises(GraphDSLError, match=r"int4_blocks: packed must be a 2-D uint8 \[out, in / 2\] tensor, got "
                                            r"\[\d, 40, 64\] torch.uint8"):
        int4_blocks(blocks)
    with pytest.raises(GraphDSLError, match=r"blocked applies to int4 weights, got bits=8"):
        IntScheme(8, None, False, blocked=True)


STACKABLE = ["int4-g32", "int4-g64-zp", "int8-channel", "fp8-channel"]


@pytest.mark.parametrize("name", STACKABLE)
def test_expert_stack_companions_and_round_trip(name):
    """A stack ``[experts, out, in]`` stores each expert's companions stacked; quantizing the
    stack equals quantizing each expert, and so does reading it back."""
    s = parse_scheme(name)
    w = torch.randn(3, 40, 128, generator=torch.Generator().manual_seed(2))
    p = Parameter((3, 40, 128), torch.float32, name="experts.gate_up_proj").quantize(name)
    stored = s.quantize_stack(w)
    assert [tuple(t.shape) for t in stored] == [tuple(c.shape) for c in p.companions()] == \
        [(3,) + c.shape for c in s.companions(40, 128)]
    assert [c.name for c in p.companions()] == [f"experts.gate_up_proj{c.suffix}" for c in s.companions(40, 128)]
    for e in range(3):
        assert all(torch.equal(a[e], b) for a, b in zip(stored, s.quantize(w[e])))
    back = s.dequantize_stack(stored, 40, 128, torch.float32)
    assert back.shape == w.shape and torch.equal(back[1], s.dequantize([t[1] for t in stored], 40, 128, torch.float32))
    assert (back - w).abs().max() / w.abs().max() < TOL[name.split("-")[0]]


@pytest.mark.parametrize("name", ["fp8-channel-dyn", "fp8-tensor", "int4-g32-act", "int4-g32-kb"])
def test_a_stack_refuses_a_scheme_it_cannot_take(name):
    with pytest.raises(GraphDSLError, match=rf"scheme '{name}' cannot store the expert stack 'experts.down_proj'"):
        Parameter((4, 16, 64), name="experts.down_proj").quantize(name)
    with pytest.raises(GraphDSLError, match=r"expert stack 'e.w' must be a 3-D \[experts, out, in\]"):
        parse_scheme("int8-channel").check_stack("e.w", (4, 16))
    with pytest.raises(GraphDSLError, match=r"'e.w' has 48 inputs, not a multiple of the group size 32"):
        Parameter((2, 16, 48), name="e.w").quantize("int4-g32")


def test_quantized_experts_record_quant_moe_experts(tmp_path):
    """``FusedExperts`` with both stacks quantized records ``quant_moe_experts`` (the schemes in its
    attributes, printed and dumped); the CPU engine equals the dense op on the dequantized stacks."""
    from graphdsl.layers import FusedExperts
    experts, hidden, inter = 4, 64, 32
    m = FusedExperts(experts, hidden, inter, dtype=torch.float32, top_k=2)
    m.gate_up_proj.quantize("int4-g32-zp")
    m.down_proj.quantize("int8-channel")
    dict(m.named_parameters())
    with Network("moe") as net:
        x, routing = Tensor("x", (3, hidden), torch.float32), Tensor("routing", (3, experts), torch.float32)
        net.mark_output(m(x, routing), "y")
    text = str(net)
    assert "= quant_moe_experts(%x, %routing, %gate_up_proj_packed" in text and "= moe_experts(" not in text
    assert "gate_up_scheme=int4-g32-zp" in text and "down_scheme=int8-channel" in text
    net.dump(tmp_path / "g.json")
    assert Network.load(tmp_path / "g.json") == net
    g = torch.Generator().manual_seed(3)
    w_up, w_down = torch.randn(experts, 2 * inter, hidden, generator=g), torch.randn(experts, hidden, inter, generator=g)
    up, down = m.gate_up_proj.quant.quantize_stack(w_up), m.down_proj.quant.quantize_stack(w_down)
    scores = torch.randn(3, experts, generator=g).softmax(-1)
    top, ids = scores.topk(2, -1)
    feed = {"x": torch.randn(3, hidden, generator=g), "routing": torch.zeros_like(scores).scatter_(1, ids, top),
            **{c.name: t for c, t in zip(m.gate_up_proj.companions() + m.down_proj.companions(), up + down)}}
    y = net.build_engine(device="cpu", backend="torch").forward(feed)["y"]
    want = F.moe_experts.opdef.reference(feed["x"], feed["routing"],
                                          m.gate_up_proj.quant.dequantize_stack(up, 2 * inter, hidden, torch.float32),
                                          m.down_proj.quant.dequantize_stack(down, hidden, inter, torch.float32))
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    m.down_proj.quantize(None)
    with Network("half") as half, pytest.raises(GraphDSLError, match="must both be quantized or neither"):
        m(Tensor("x", (3, hidden), torch.float32), Tensor("routing", (3, experts), torch.float32))
    del half


def test_the_quantized_experts_reference_reads_only_routed_experts():
    """The CPU reference dequantizes only the experts some token routes to (a real MoE model has
    many more experts than a step uses): an unrouted expert's damaged scales change nothing."""
    s = parse_scheme("int4-g32")
    g = torch.Generator().manual_seed(5)
    up, down = s.quantize_stack(torch.randn(4, 64, 64, generator=g)), s.quantize_stack(torch.randn(4, 64, 32, generator=g))
    x, routing = torch.randn(3, 64, generator=g), torch.zeros(3, 4)
    routing[:, 1], routing[0, 3] = 0.7, 0.3
    kw = dict(gate_up_scheme="int4-g32", down_scheme="int4-g32", experts=4, hidden=64, intermediate=32)
    ref = F.quant_moe_experts.opdef.reference
    want = ref(x, routing, *up, *down, **kw)
    up[1][[0, 2]] = float("nan")
    got = ref(x, routing, *up, *down, **kw)
    assert torch.equal(got, want) and torch.isfinite(got).all()
    assert torch.equal(ref(x[:0], routing[:0], *up, *down, **kw), x[:0])
