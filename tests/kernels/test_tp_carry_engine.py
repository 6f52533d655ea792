"""runtime/backends/tp_carry.py: which TP sites the Triton backend leaves to the GEMVs around them,
that the memory plan keeps the norm's inputs alive through the consumer, and that the carried
engine writes what the plain one does. The engine runs under the interpreter with one simulated
rank (no process group: the carry buffers are this process's own), so the all-reduce is the
identity; sums over real ranks are tests/kernels/test_tp_carry.py's."""
import pytest
import torch

from graphdsl import Dim, Network, Parameter, Tensor
from graphdsl import functional as F
from graphdsl.quant import parse_scheme

H, I = 64, 96
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _block(world_size: int, *, swiglu: bool = False, normed_output: bool = False, y_output: bool = False,
           scheme: str | None = None):
    """x -> o projection -> all_reduce -> (+ residual, RMSNorm) -> down (or gate|up + SwiGLU) projection;
    the residual is made by a projection too (so the memory plan places it). ``scheme``: the o and
    down projections' weights quantized so (``quant_linear``)."""
    n = Dim("num_tokens", max=64)
    with Network("tp_block") as net:
        x = Tensor("x", (n, H), torch.bfloat16)
        r = Tensor("r", (n, H), torch.bfloat16)
        w0 = Tensor("w0", (H, H), torch.bfloat16)
        res = F.linear(r, w0, transpose_b=True)
        if scheme is None:
            w1, w2 = Tensor("w1", (H, H), torch.bfloat16), Tensor("w2", (2 * I if swiglu else H, H), torch.bfloat16)
        else:
            w1, w2 = (Parameter((H, H), torch.bfloat16, name=k).quantize(parse_scheme(scheme)) for k in ("w1", "w2"))
        g = Tensor("g", (H,), torch.bfloat16)
        y = F.linear(x, w1, transpose_b=True)
        if world_size > 1:
            y = F.all_reduce(y, world_size=world_size)
        s = res + y
        normed = F.rms_norm(s, g, eps=1e-5)
        if swiglu:                                  # a packed [gate | up] weight, SwiGLU in the GEMV's epilogue
            from graphdsl.passes.fused_ops import matmul_silu_mul
            h = matmul_silu_mul(normed, w2, transpose_b=True)
        else:
            h = F.linear(normed, w2, transpose_b=True)
        net.mark_output(h, "out")
        net.mark_output(s, "s")
        if normed_output:
            net.mark_output(normed, "normed")
        if y_output:
            net.mark_output(y, "y")
    return net


def _weights(swiglu=False, seed=0, scheme=None):
    gen = torch.Generator().manual_seed(seed)
    w = {"w0": (torch.randn(H, H, generator=gen) / 8).bfloat16(),
         "w1": (torch.randn(H, H, generator=gen) / 8).bfloat16(),
         "w2": (torch.randn(2 * I if swiglu else H, H, generator=gen) / 8).bfloat16(),
         "g": (1 + 0.1 * torch.randn(H, generator=gen)).bfloat16()}
    if scheme is not None:                  # the companions' names: <weight>_packed, <weight>_scale, ...
        s = parse_scheme(scheme)
        for k in ("w1", "w2"):
            stored = s.quantize(w.pop(k).float(), torch.bfloat16)
            w.update(zip([c.name for c in Parameter((H, H), torch.bfloat16, name=k).quantize(s).companions()],
                         stored))
    return w


def _sites(net):
    from graphdsl.runtime.backends.tp_carry import plan
    eng = net.build_engine(backend="triton", cache=False)
    nodes = list(eng.net.nodes)
    return eng, nodes, plan(nodes)


@pytest.mark.parametrize("swiglu", [False, True])
def test_the_four_nodes_of_a_tp_site_are_planned(swiglu):
    _, nodes, sites = _sites(_block(2, swiglu=swiglu))
    site, = set(sites.values())
    four = (site.producer, site.reduce, site.norm, site.consumer)
    assert [n.op for n in four] == ["matmul", "all_reduce", "add_rms_norm", "matmul_silu_mul" if swiglu else "matmul"]
    assert site.norm.inputs[site.y_input] is site.reduce.outputs[0]
    assert [nodes.index(n) for n in four] == list(range(nodes.index(site.producer), nodes.index(site.producer) + 4))


@pytest.mark.parametrize("world, kw", [(2, dict(normed_output=True)), (2, dict(y_output=True)), (1, {})])
def test_no_site_where_its_rows_are_outputs_or_nothing_is_reduced(world, kw):
    """The partial or the normed rows read outside the four nodes (a graph output), or no
    all-reduce at all: nothing to carry."""
    assert _sites(_block(world, **kw))[2] == {}


def _carried_and_not(monkeypatch, build, weights: dict, feed: dict):
    """One simulated rank: ``build()``'s triton engine run with the carry on and off, each run's
    outputs and what it launched for the all-reduce and the norm; the carry buffers; the last engine."""
    from graphdsl.runtime.backends import tp_carry as carry_mod
    from graphdsl.runtime.backends import triton_backend
    from graphdsl.runtime.distributed import collectives
    from graphdsl.runtime.kernels import allreduce
    from graphdsl.runtime.kernels.allreduce import local_peers
    from graphdsl.runtime.kernels.tp_carry import local_carry_buffers
    peers = local_peers(1, 64 * H, torch.bfloat16, DEV)[0]
    bufs = local_carry_buffers(1, carry_mod.MAX_ROWS * H, torch.bfloat16, DEV)[0]
    monkeypatch.setattr(collectives, "_device_ok", lambda x: True)
    monkeypatch.setattr(collectives, "_dist", lambda world_size: object())
    monkeypatch.setattr(collectives, "_peers", lambda *a: peers)
    monkeypatch.setattr(collectives, "carry_buffers", lambda *a: bufs)
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "symm_mem")
    launched = []
    real_norm = triton_backend._LOWERINGS["add_rms_norm"]
    monkeypatch.setitem(triton_backend._LOWERINGS, "add_rms_norm",
                        lambda be, node, *a: launched.append(node.op) or real_norm(be, node, *a))
    real_ar = collectives.COLLECTIVE_LOWERINGS["all_reduce"]
    monkeypatch.setitem(triton_backend.COLLECTIVE_LOWERINGS, "all_reduce",
                        lambda be, node, *a: launched.append(node.op) or real_ar(be, node, *a))
    real_one_shot = allreduce.one_shot_all_reduce
    monkeypatch.setattr(allreduce, "one_shot_all_reduce",
                        lambda *a, **kw: launched.append("one-shot") or real_one_shot(*a, **kw))
    got = {}
    for carry in ("1", "0"):
        monkeypatch.setenv("GRAPHDSL_TP_CARRY", carry)
        eng = build().build_engine(backend="triton", cache=False)
        eng.set_weights({k: v.to(DEV) for k, v in weights.items()})
        launched.clear()
        got[carry] = eng.forward({k: v.clone().to(DEV) for k, v in feed.items()})
        got[carry]["launched"] = list(launched)
    return got, bufs, eng


def _feed(rows: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    return {"x": torch.randn(rows, H, generator=gen).bfloat16(), "r": torch.randn(rows, H, generator=gen).bfloat16()}


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_the_carried_engine_writes_what_the_plain_one_does(swiglu, rows, monkeypatch):
    """The carried engine's outputs equal, bit for bit, the engine's with the all-reduce and the
    norm fused in one launch (the one-shot path), and neither the all-reduce nor the norm launches
    anything of its own. Five rows are more than a carried site takes: both run as before."""
    from graphdsl.runtime.backends.tp_carry import MAX_ROWS
    feed = _feed(rows)
    got, bufs, eng = _carried_and_not(monkeypatch, lambda: _block(2, swiglu=swiglu), _weights(swiglu), feed)
    # the residual dies at the norm, but the consumer's GEMV reads it: its bytes stay its own until then
    nodes = list(eng.net.nodes)
    norm = next(n for n in nodes if n.op == "add_rms_norm")
    residual = next(t for t in norm.inputs if t.producer is not None and t.producer.op == "matmul")
    buf, = [b for b in eng.last_plan.memory.buffers if residual.name in b.tensors]
    assert buf.end == nodes.index(norm) + 1
    carried = rows <= MAX_ROWS
    assert got["1"]["launched"] == ([] if carried else ["one-shot"])
    assert got["0"]["launched"] == ["one-shot"]          # the one-shot launch that also normalises
    for k in ("out", "s"):
        assert torch.equal(got["1"][k], got["0"][k]), k
    assert bufs.calls.tolist() == ([1, 1] if carried else [0, 0])
    ref = _block(1, swiglu=swiglu).build_engine(backend="torch", passes=[]).forward(
        {**_weights(swiglu), **{k: v.clone() for k, v in feed.items()}})
    torch.testing.assert_close(got["1"]["out"].cpu().float(), ref["out"].float(), rtol=5e-2, atol=8e-2)


@pytest.mark.parametrize("scheme", ["int4-g64", "fp8-channel"])
def test_quantized_projections_are_carried_too(scheme, monkeypatch):
    """Weight-only quantized o and down projections (``quant_linear``) on both sides of the site."""
    from graphdsl.runtime.backends.tp_carry import plan
    got, bufs, eng = _carried_and_not(monkeypatch, lambda: _block(2, scheme=scheme), _weights(scheme=scheme),
                                      _feed(1))
    site, = set(plan(list(eng.net.nodes)).values())
    assert site.producer.op == site.consumer.op == "quant_linear"
    assert got["1"]["launched"] == [] and got["0"]["launched"] == ["one-shot"]
    for k in ("out", "s"):
        assert torch.equal(got["1"][k], got["0"][k]), k
    assert bufs.calls.tolist() == [1, 1]


def test_off_by_default_and_a_bad_setting_is_named(monkeypatch):
    from graphdsl.errors import GraphDSLError
    from graphdsl.runtime.backends.tp_carry import enabled
    monkeypatch.delenv("GRAPHDSL_TP_CARRY", raising=False)
    assert not enabled()
    monkeypatch.setenv("GRAPHDSL_TP_CARRY", "maybe")
    with pytest.raises(GraphDSLError, match=r"GRAPHDSL_TP_CARRY must be one of 1/true/on/yes \(on\) or 0/false/off/no \(off\), got 'maybe'"):
        enabled()
