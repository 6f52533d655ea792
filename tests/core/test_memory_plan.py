"""Memory plan: one arena, liveness-based sharing, in-place reuse; never two live tensors on one byte."""
import torch

from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F
from graphdsl.passes.memory_plan import plan_memory


def _mlp(layers=10, hidden=64):
    n = Dim("n", max=64)
    with Network("mlp10") as net:
        x = Tensor("x", (n, hidden), "float32")
        ws = [(Tensor(f"w{i}a", (hidden, 4 * hidden), "float32"), Tensor(f"w{i}b", (4 * hidden, hidden), "float32"))
              for i in range(layers)]
        for a, b in ws:
            x = x + F.linear(F.gelu(F.linear(x, a)), b)
        net.mark_output(x, "y")
    return net


def _check_no_overlap(plan):
    bufs = plan.buffers
    for i, a in enumerate(bufs):
        for b in bufs[i + 1:]:
            live = a.start <= b.end and b.start <= a.end
            disjoint = a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
            assert not live or disjoint, (a, b)


def test_ten_layer_mlp_arena_is_smaller_than_sum_and_correct():
    net = _mlp()
    eng = net.build_engine()
    weights = {name: torch.randn(t.shape) * 0.05 for name, t in net.inputs.items() if name != "x"}
    eng.set_weights(weights)
    x = torch.randn(33, 64)
    y = eng.forward({"x": x})["y"]
    ref = x
    for i in range(10):
        ref = ref + torch.nn.functional.gelu(ref @ weights[f"w{i}a"]) @ weights[f"w{i}b"]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    m = eng.last_plan.memory
    assert m.arena_bytes < m.intermediate_bytes
    assert m.arena_bytes <= 3 * 33 * 4 * 64 * 4 + 3 * 256      # a few [n, 4h] float32 buffers, not 10 layers' worth
    _check_no_overlap(m)


def test_in_place_reuse_for_pointwise_chain():
    with Network() as net:
        x = Tensor("x", (8, 8), "float32")
        y = F.exp(F.matmul(x, x))
        z = F.neg(F.sigmoid(y))
        net.mark_output(F.matmul(z, x), "o")
    specs = {}
    for t in net.tensors():
        specs[t.name] = (t.shape, t.dtype)
    plan = plan_memory(net, specs)
    chains = [b.tensors for b in plan.buffers if len(b.tensors) > 1]
    assert ["matmul_0", "exp_1", "sigmoid_2", "neg_3"] in chains
    _check_no_overlap(plan)


def test_views_keep_their_base_alive():
    with Network() as net:
        x = Tensor("x", (4, 6), "float32")
        base = F.exp(x)
        view = base.reshape(6, 4)
        other = F.neg(x)                     # must not take base's bytes: view is read later
        net.mark_output(F.matmul(view, F.reshape(other, (4, 6))), "o")
    specs = {t.name: (t.shape, t.dtype) for t in net.tensors()}
    plan = plan_memory(net, specs)
    _check_no_overlap(plan)
    eb = next(b for b in plan.buffers if "exp_0" in b.tensors)
    assert eb.end >= 4
    x = torch.randn(4, 6)
    torch.testing.assert_close(net.build_engine().forward({"x": x})["o"], x.exp().reshape(6, 4) @ (-x))


def test_a_last_dim_gathers_rows_live_through_its_reader():
    """``gather(x, -1, perm)`` (act-order's): ``x`` stays live while the gathered copy does, so the
    reader's output never takes ``x``'s bytes (a backend may read ``x`` through ``perm`` instead of
    the copy); a gather along another dim does not extend its input's life."""
    def net_of(dim):
        with Network() as net:
            x = Tensor("x", (4, 8), "float32")
            perm = Tensor("perm", (8,) if dim else (4,), torch.int32)
            rows = F.exp(x)
            g = F.gather(rows, dim, perm)
            net.mark_output(F.neg(F.matmul(g, Tensor("w", (8, 8), "float32"))), "o")
        return net
    for dim, extended in ((-1, True), (0, False)):
        net = net_of(dim)
        plan = plan_memory(net, {t.name: (t.shape, t.dtype) for t in net.tensors()})
        _check_no_overlap(plan)
        rows = next(b for b in plan.buffers if "exp_0" in b.tensors)
        gathered = next(b for b in plan.buffers if any(t.startswith("gather") for t in b.tensors))
        assert (rows.end >= gathered.end) == extended, (dim, rows, gathered)


def test_node_workspace_is_live_during_its_node_only():
    """A workspace (OpDef.workspace) gets arena bytes that overlap neither the node's inputs nor
    its outputs, and may share bytes with tensors dead before or born after the node."""
    from graphdsl.opdef import Spec
    from graphdsl.passes.fused_ops import matmul_silu_mul
    with Network() as net:
        x = Tensor("x", (4, 16), "float32")
        w = Tensor("w", (32, 16), "float32")
        y = F.exp(matmul_silu_mul(F.exp(x), w, transpose_b=True))     # exp(x) dies at the fused node
        net.mark_output(F.exp(y), "z")
    node = next(n for n in net.nodes if n.op == "matmul_silu_mul")
    scratch = node.opdef.workspace_spec([Spec((4, 16), torch.float32), Spec((32, 16), torch.float32)],
                                        {"transpose_a": False, "transpose_b": True})
    assert scratch == Spec((4, 32), torch.float32)                   # the product [gate | up]
    specs = {"x": ((4, 16), torch.float32), "w": ((32, 16), torch.float32)}
    specs.update({t.name: ((4, 16), torch.float32) for n in net.nodes for t in n.outputs})
    plan = plan_memory(net, specs, {node.name: (scratch.shape, scratch.dtype)})
    _check_no_overlap(plan)
    assert list(plan.workspace_slots) == [node.name]
    off, nbytes = plan.workspace_slots[node.name]
    step = net.nodes.index(node)
    (buf,) = [b for b in plan.buffers if b.tensors == [f"{node.name} (workspace)"]]
    assert (nbytes, buf.start, buf.end, buf.offset) == (4 * 32 * 4, step, step, off)


def test_engine_runs_a_workspace_op_from_its_arena():
    from graphdsl.passes.fused_ops import matmul_silu_mul
    with Network() as net:
        x = Tensor("x", (Dim("n"), 16), "float32")
        w = Tensor("w", (32, 16), "float32")
        net.mark_output(F.exp(matmul_silu_mul(x, w, transpose_b=True)), "y")
    eng = net.build_engine(backend="torch", passes=[])
    x, w = torch.randn(5, 16), torch.randn(32, 16)
    y = eng.forward({"x": x, "w": w})["y"]
    p = x @ w.T
    torch.testing.assert_close(y, torch.exp(torch.nn.functional.silu(p[:, :16]) * p[:, 16:]))
    assert list(eng.last_plan.memory.workspace_slots) == [net.nodes[0].name]
    assert eng.last_plan.memory.arena_bytes >= 5 * 32 * 4
