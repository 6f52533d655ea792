"""runtime/backends/allreduce_norm.py: which all-reduces the Triton backend runs together with the
add + RMSNorm after them (``collectives.norm_after``), and that the fused launch writes the norm's
outputs where the engine reads them. The engine test runs under the interpreter with one simulated
rank (no process group: the peer buffers are this process's own), so the all-reduce is the
identity and the engine must match the same block recorded without it; the sums over real ranks
are tests/kernels/test_allreduce_kernel.py's and the GPU test's."""
import pytest
import torch

from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F

H = 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _block(world_size: int, *, s_output: bool = True, y_output: bool = False, second_reader: bool = False):
    """x -> o projection -> all_reduce -> (+ residual, RMSNorm) -> down projection."""
    n = Dim("num_tokens", max=64)
    with Network("tp_block") as net:
        x = Tensor("x", (n, H), torch.bfloat16)
        res = Tensor("res", (n, H), torch.bfloat16)
        w1, w2 = Tensor("w1", (H, H), torch.bfloat16), Tensor("w2", (H, H), torch.bfloat16)
        g = Tensor("g", (H,), torch.bfloat16)
        y = F.linear(x, w1, transpose_b=True)
        if world_size > 1:
            y = F.all_reduce(y, world_size=world_size)
        s = res + y
        out = F.linear(F.rms_norm(s, g, eps=1e-5), w2, transpose_b=True)
        if second_reader:
            out = out + y
        net.mark_output(out, "out")
        if s_output:
            net.mark_output(s, "s")
        if y_output:
            net.mark_output(y, "y")
    return net


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"w1": (torch.randn(H, H, generator=gen) / 8).bfloat16(),
            "w2": (torch.randn(H, H, generator=gen) / 8).bfloat16(),
            "g": (1 + 0.1 * torch.randn(H, generator=gen)).bfloat16()}


def _pairs(net):
    from graphdsl.runtime.distributed.collectives import norm_after
    eng = net.build_engine(backend="triton", cache=False)
    nodes = list(eng.net.nodes)
    return nodes, norm_after(nodes)


def test_the_norm_right_after_an_all_reduce_is_paired_with_it():
    nodes, pairs = _pairs(_block(2))
    (ar, (norm, i)), = pairs.items()
    assert ar.op == "all_reduce" and norm.op == "add_rms_norm"
    assert nodes.index(norm) == nodes.index(ar) + 1 and norm.inputs[i] is ar.outputs[0]


@pytest.mark.parametrize("kw", [dict(y_output=True), dict(second_reader=True)])
def test_an_all_reduce_read_elsewhere_is_not_paired(kw):
    assert _pairs(_block(2, **kw))[1] == {}


def test_no_pairs_without_an_all_reduce():
    assert _pairs(_block(1))[1] == {}


@pytest.mark.parametrize("enabled", [True, False])
def test_the_fused_launch_writes_the_norms_outputs(enabled, monkeypatch):
    """One simulated rank: the all-reduce is the identity, so the engine of the world-size-2 block
    equals the block without it; with the pair fused the norm's own kernel never launches, without
    it the plain one-shot all-reduce runs and then the norm's kernel."""
    from graphdsl.runtime.backends import allreduce_norm, triton_backend
    from graphdsl.runtime.distributed import collectives
    from graphdsl.runtime.kernels.allreduce import local_peers
    peers = local_peers(1, 64 * H, torch.bfloat16, DEV)[0]
    monkeypatch.setattr(collectives, "_device_ok", lambda x: True)
    monkeypatch.setattr(collectives, "_dist", lambda world_size: object())
    monkeypatch.setattr(collectives, "_peers", lambda *a: peers)
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "symm_mem")
    monkeypatch.setattr(allreduce_norm, "ENABLED", enabled)
    launched = []
    real = triton_backend._LOWERINGS["add_rms_norm"]
    monkeypatch.setitem(triton_backend._LOWERINGS, "add_rms_norm",
                        lambda be, node, *a: launched.append(node.name) or real(be, node, *a))
    w = _weights()
    gen = torch.Generator().manual_seed(1)
    feed = {"x": torch.randn(3, H, generator=gen).bfloat16(), "res": torch.randn(3, H, generator=gen).bfloat16()}
    eng = _block(2).build_engine(backend="triton", cache=False)
    eng.set_weights({k: v.to(DEV) for k, v in w.items()})
    got = eng.forward({k: v.clone().to(DEV) for k, v in feed.items()})
    ref = _block(1).build_engine(backend="torch", passes=[]).forward({**w, **{k: v.clone() for k, v in feed.items()}})
    torch.testing.assert_close(got["s"].cpu().float(), ref["s"].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got["out"].cpu().float(), ref["out"].float(), rtol=3e-2, atol=3e-2)
    assert launched == ([] if enabled else [n.name for n in eng.net.nodes if n.op == "add_rms_norm"])
    assert int(peers.epoch[:3].min()) == 1 and int(peers.epoch[3:].max()) == 0   # one call, a program a row


def test_which_tensors_take_the_one_shot_path(monkeypatch):
    """Rows as they are up to the widest a program holds; a contiguous sum of wider rows in rows of
    4096 (the plain all-reduce only: a norm needs its real rows); nothing above the byte limit,
    in other dtypes, or with the path turned off."""
    from graphdsl.runtime.distributed import collectives as c
    monkeypatch.setattr(c, "_device_ok", lambda x: True)
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "symm_mem")
    bf = torch.bfloat16
    assert c._one_shot_ok(torch.zeros(2, 4096, dtype=bf))
    wide = torch.zeros(32768, dtype=bf)
    assert not c._one_shot_ok(wide) and c._one_shot_ok(wide, rows=c._flat_rows)
    assert c._flat_rows(wide).shape == (8, 4096)
    assert c._flat_rows(torch.zeros(3, 40000, dtype=bf)[:, :32768]) is None      # rows too wide, not contiguous
    # once a group's buffers hold rows of some width, a plain sum is cut into rows of that width
    assert c._flat_rows(torch.zeros(8192, dtype=bf), 4096).shape == (2, 4096)
    assert c._flat_rows(torch.zeros(3, 2048, dtype=bf), 4096) is None            # 6144 elements: no whole rows
    assert c._flat_rows(torch.zeros(4, 40, dtype=bf)[:, :32], 32).shape == (4, 32)   # own rows, strided
    assert not c._one_shot_ok(torch.zeros(2, 4096, dtype=torch.int32))
    assert not c._one_shot_ok(torch.zeros(512, 1024, dtype=bf))                  # 1 MiB > the 512 KiB limit
    monkeypatch.setenv("GRAPHDSL_ONESHOT_MAX_BYTES", str(2 << 20))
    assert c._one_shot_ok(torch.zeros(512, 1024, dtype=bf))
    assert not c._one_shot_ok(torch.zeros(2, 4096, dtype=bf), torch.zeros(2, 4096, dtype=torch.float32))
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "nccl")
    assert not c._one_shot_ok(torch.zeros(2, 4096, dtype=bf))


def test_rows_of_another_width_than_the_groups_first_are_declined(monkeypatch):
    """The buffers keep their first call's row width; the fused launch declines other widths (the
    engine then runs the all-reduce and the norm apart), and touches nothing."""
    from graphdsl.runtime.distributed import collectives
    from graphdsl.runtime.kernels.allreduce import local_peers
    peers = local_peers(1, 64 * H, torch.bfloat16, DEV)[0]
    peers.width = 2 * H
    monkeypatch.setattr(collectives, "_device_ok", lambda x: True)
    monkeypatch.setattr(collectives, "_dist", lambda world_size: object())
    monkeypatch.setattr(collectives, "_peers", lambda *a: peers)
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "symm_mem")
    x, res = (torch.ones(2, H, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    w = torch.ones(H, dtype=torch.bfloat16, device=DEV)
    out, s = torch.zeros_like(x), torch.zeros_like(x)
    assert not collectives.all_reduce_add_rms_norm(x, res, w, 1e-5, out, s, 2)
    assert int(out.abs().sum()) == 0 and int(peers.epoch.sum()) == 0
    peers.width = H
    assert collectives.all_reduce_add_rms_norm(x, res, w, 1e-5, out, s, 2)
    assert torch.equal(s, torch.full_like(x, 2.0)) and int(peers.epoch[:2].sum()) == 2


def test_plain_all_reduces_of_several_sizes_keep_the_one_shot_path(monkeypatch):
    """benchmarks/allreduce.py's 1-D messages of 8-32 KiB, then a [3, 4096] step: all in rows of the
    group's first width (4096), none sent to NCCL (the patched group has no all_reduce to fall to)."""
    from graphdsl.runtime.distributed import collectives
    from graphdsl.runtime.kernels.allreduce import local_peers
    peers = local_peers(1, 64 * 4096, torch.bfloat16, DEV)[0]
    monkeypatch.setattr(collectives, "_device_ok", lambda x: True)
    monkeypatch.setattr(collectives, "_dist", lambda world_size: object())
    monkeypatch.setattr(collectives, "_peers", lambda *a: peers)
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "symm_mem")
    for x in (torch.randn(4096), torch.randn(8192), torch.randn(16384), torch.randn(3, 4096)):
        x = x.bfloat16().to(DEV)
        dst = torch.empty_like(x)
        assert collectives._all_reduce(None, None, [x], {"world_size": 2}, [dst])[0] is dst
        assert torch.equal(dst, x)                     # one simulated rank: the sum is x
    assert peers.width == 4096 and peers.epoch[:4].tolist() == [4, 3, 2, 1]
