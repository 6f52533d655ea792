"""The ``lora_epilogue`` rules (``matmul_epilogue`` pass): ``lora_apply(matmul(x, w), x, A, B, idx)``
joins the projection (``matmul_lora``), then its SwiGLU / bias / residual epilogue (``matmul_silu_mul_lora``,
``matmul_add_lora``); numbers equal the unfused graph (torch backend); the base engine of a model
is untouched and a LoRA decode layer keeps the base layer's fusions."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F
from graphdsl.passes import PassManager

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

S, R = 3, 4      # slots, slot width


def optimise(net: Network, **kw) -> Network:
    work = Network.from_json(net.to_json())
    PassManager(lint=True, **kw).run(work)
    work.lint()
    return work


def ops_of(net: Network) -> list[str]:
    return [n.op for n in net.nodes]


def _lora(x, y, name, k, n, idx):
    a = Tensor(f"{name}.A", (S, R, k), torch.float32)
    b = Tensor(f"{name}.B", (n, S, R), torch.float32)
    return F.lora_apply(y, x, a, b, idx)


def _feed(net: Network, t: int) -> dict:
    g = torch.Generator().manual_seed(0)
    feed = {}
    for name, tensor in net.inputs.items():
        if name == "idx":
            feed[name] = torch.tensor([(i % (S + 1)) - 1 for i in range(t)], dtype=torch.int32)
        else:
            shape = [t if not isinstance(d, int) else d for d in tensor.shape]
            feed[name] = torch.randn(*shape, generator=g) * 0.5
    return feed


def _same_numbers(net: Network, t: int = 5):
    feed = _feed(net, t)
    ref = net.build_engine(backend="torch", passes=[]).forward({k: v.clone() for k, v in feed.items()})
    got = net.build_engine(backend="torch").forward({k: v.clone() for k, v in feed.items()})
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(ref[k], net.build_engine(backend="torch", passes=[]).forward(
            {**{k2: v.clone() for k2, v in feed.items()}, "idx": torch.full((t,), -1, dtype=torch.int32)})[k])


def _mlp_net(with_lora: bool) -> Network:
    n = Dim("num_tokens")
    with Network("mlp") as net:
        x = Tensor("x", (n, 16), torch.float32)
        res = Tensor("res", (n, 16), torch.float32)
        idx = Tensor("idx", (n,), torch.int32)
        gu = F.linear(x, Tensor("w_gu", (64, 16), torch.float32), transpose_b=True)
        if with_lora:
            gu = _lora(x, gu, "gu", 16, 64, idx)
        gate, up = F.split(gu, 2, -1)
        h = F.silu(gate) * up
        d = F.linear(h, Tensor("w_d", (16, 32), torch.float32), transpose_b=True)
        if with_lora:
            d = _lora(h, d, "d", 32, 16, idx)
        net.mark_output(res + d, "y")
    return net


def test_lora_projection_keeps_swiglu_and_residual_epilogues():
    work = optimise(_mlp_net(True), disable=["generic_fusion"])
    assert ops_of(work) == ["matmul_silu_mul_lora", "matmul_add_lora"]
    gu, d = work.nodes
    assert [t.name for t in gu.inputs] == ["x", "w_gu", "gu.A", "gu.B", "idx"]
    assert [t.name for t in d.inputs][2:] == ["res", "d.A", "d.B", "idx"]
    assert "matmul_silu_mul_lora(" in str(work)                     # the dump names the fused op
    base = optimise(_mlp_net(False), disable=["generic_fusion"])
    assert ops_of(base) == ["matmul_silu_mul", "matmul_add"]        # the same epilogues, one op each
    _same_numbers(_mlp_net(True))


def test_bias_and_bare_projection():
    n = Dim("num_tokens")
    with Network("qkv") as net:
        x = Tensor("x", (n, 16), torch.float32)
        idx = Tensor("idx", (n,), torch.int32)
        y = F.linear(x, Tensor("w", (24, 16), torch.float32), Tensor("bias", (24,), torch.float32), transpose_b=True)
        y = _lora(x, y, "qkv", 16, 24, idx)                     # a biased projection (qwen2's qkv)
        z = F.linear(y, Tensor("w2", (8, 24), torch.float32), transpose_b=True)
        z = _lora(y, z, "o", 24, 8, idx)                        # read by a non-epilogue op: stays bare
        net.mark_output(F.rms_norm(z, Tensor("g", (8,), torch.float32)), "out")
    work = optimise(net, disable=["generic_fusion"])
    assert ops_of(work) == ["matmul_add_lora", "matmul_lora", "rms_norm"]
    assert [t.name for t in work.nodes[0].inputs] == ["x", "w", "bias", "qkv.A", "qkv.B", "idx"]
    _same_numbers(net)


def test_lora_term_of_another_input_is_not_fused():
    """lora_apply's x must be the matmul's own input; otherwise the op stays as recorded."""
    n = Dim("num_tokens")
    with Network("other") as net:
        x, x2 = Tensor("x", (n, 16), torch.float32), Tensor("x2", (n, 16), torch.float32)
        idx = Tensor("idx", (n,), torch.int32)
        y = F.linear(x, Tensor("w", (8, 16), torch.float32), transpose_b=True)
        net.mark_output(_lora(x2, y, "l", 16, 8, idx), "out")
    assert ops_of(optimise(net)) == ["matmul", "lora_apply"]


def test_disabled_pass_leaves_lora_apply():
    work = optimise(_mlp_net(True), disable=["generic_fusion", "matmul_epilogue"])
    assert "lora_apply" in ops_of(work) and "silu_mul" in ops_of(work)


# -- a model's decode engines: base untouched, LoRA keeps the base fusions --------------------------
@pytest.fixture(scope="module")
def tiny():
    from tests.helpers.soak import tiny_llm
    llm = tiny_llm("cpu", num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=64)
    llm.enable_lora(max_loras=2, max_lora_rank=8)
    return llm


def test_lora_decode_engine_is_the_base_engine_with_lora_projections(tiny):
    from graphdsl.layers import Phase
    base = tiny.model.engine(Phase.DECODE).net
    lora = tiny.model.engine(Phase.DECODE, lora=True).net
    assert not any(n.op.endswith("_lora") or n.op == "lora_apply" for n in base.nodes)
    swap = {"matmul_silu_mul": "matmul_silu_mul_lora", "matmul_add": "matmul_add_lora"}
    targets = set(tiny.model.lora.targets)
    want = []
    for node in base.nodes:                     # each targeted projection gains its LoRA operands, in place
        w = node.inputs[1].name if node.category.name == "MATMUL" and len(node.inputs) > 1 else ""
        adapted = w.rsplit(".", 1)[0] in targets
        want.append(swap.get(node.op, "matmul_lora") if adapted else node.op)
    assert ops_of(lora) == want
    assert sum(op.endswith("_lora") for op in want) == 4 * 2            # qkv, o, gate_up, down per layer
    assert "silu_mul" not in ops_of(lora) and ops_of(lora).count("add_rms_norm") == ops_of(base).count("add_rms_norm")
    launches = tiny.model.engine(Phase.DECODE, lora=True).backend.launches
    assert launches(lora) == launches(base)     # graph nodes; each LoRA projection adds one shrink kernel
