"""One int4 decode row's activation bytes made by one launch (runtime/kernels/int4_acts.py) and read
by the GEMV (``gemv(..., xpack=)``): the bytes equal their torch reference, and the GEMV's sums are
the same bits as when it makes the bytes itself."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.quant import parse_scheme
from graphdsl.runtime.kernels.gemv import GemvWorkspace, gemv
from graphdsl.runtime.kernels.int4_acts import pack_int4_activations, pack_int4_activations_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _fixed_point(planes: torch.Tensor) -> torch.Tensor:
    """The ``[K]`` fixed-point activations the planes hold (signed high byte · 256 + low byte)."""
    def lanes(p):
        return torch.stack([(p.to(torch.int64) >> (8 * i)) & 255 for i in range(4)], dim=1)     # [W, 4]
    hi = [torch.where(h >= 128, h - 256, h) for h in (lanes(planes[0]), lanes(planes[1]))]
    lo = [lanes(planes[2]), lanes(planes[3])]
    q = torch.empty(planes.shape[1], 8, dtype=torch.int64)
    q[:, 0::2], q[:, 1::2] = hi[0] * 256 + lo[0], hi[1] * 256 + lo[1]
    return q.reshape(-1)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_bytes_equal_the_reference(group, dtype):
    k = 4 * group
    x = (torch.randn(k, generator=torch.Generator().manual_seed(group)) * 3).to(dtype)
    x[:group] = 0.0                                        # an all-zero group: a = 0, every byte 0
    x[group + 5] = 300.0                                   # a group dominated by one input
    got = pack_int4_activations(x.to(DEV), group).cpu()
    want = pack_int4_activations_reference(x, group, fused=DEV == "cuda")    # compiled: x * inv + c is one FMA
    assert got.shape == (6, k // 8) and got.dtype == torch.int32
    assert torch.equal(got[5, :k // group], want[5, :k // group])            # the groups' units a
    q, q_want = _fixed_point(got), _fixed_point(want)
    assert torch.equal(got[4], q.reshape(-1, 8).sum(dim=1).to(torch.int32))  # each word's sum of its own values
    if DEV == "cpu":
        assert torch.equal(got[:5], want[:5])
    else:       # ptxas may fuse x * inv + 1.5 * 2^23 or not: a value then rounds to its neighbour
        assert int((q - q_want).abs().max()) <= 1 and float((q == q_want).float().mean()) > 0.99
    assert int(q[:group].abs().sum()) == 0 and int(q.abs().max()) <= 32767


@pytest.mark.parametrize("name", ["int4-g128", "int4-g64-zp", "int4-g64", "int4-g128-zp"])
@pytest.mark.parametrize("epilogue", [None, "residual", "silu_mul"])
@pytest.mark.parametrize("split", [1, 2])
def test_gemv_reading_packed_bytes_gives_the_same_bits(name, epilogue, split):
    s = parse_scheme(name)
    n, k = 96, 512
    stored = [t.to(DEV) for t in s.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)),
                                            torch.bfloat16)]
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)
    add = torch.randn(1, n, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16) \
        if epilogue == "residual" else None
    cfg = dict(BLOCK_N=32, BLOCK_K=2 * s.group_size, SPLIT_K=split, num_warps=4, num_stages=2, INT_DOT=True)
    kw = dict(silu_mul=epilogue == "silu_mul", scheme=s, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
    plain = gemv(x, stored[0], add, config=cfg, workspace=GemvWorkspace(), **kw)
    packed = gemv(x, stored[0], add, config=cfg, workspace=GemvWorkspace(),
                  xpack=pack_int4_activations(x, s.group_size), **kw)
    assert torch.equal(plain, packed)


def test_default_packed_launch_matches_the_dequantized_product():
    s = parse_scheme("int4-g128")
    n, k = 200, 1024
    stored = [t.to(DEV) for t in s.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(4)),
                                            torch.bfloat16)]
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    want = x.float() @ s.dequantize(stored, n, k, torch.float32).T
    got = gemv(x, stored[0], scheme=s, scales=stored[1], xpack=pack_int4_activations(x, 128))
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_errors_name_the_operand():
    s = parse_scheme("int4-g128")
    stored = [t.to(DEV) for t in s.quantize(torch.randn(64, 256), torch.bfloat16)]
    x = torch.randn(1, 256).to(DEV, torch.bfloat16)
    planes = pack_int4_activations(x, 128)
    with pytest.raises(GraphDSLError, match=r"xpack must be a contiguous int32 \[6, 32\].*\[6, 16\]"):
        gemv(x, stored[0], scheme=s, scales=stored[1], xpack=planes[:, :16].contiguous())
    with pytest.raises(GraphDSLError, match=r"xpack is for one row of an int4 weight, got 2 rows"):
        gemv(x.expand(2, 256).contiguous(), stored[0], scheme=s, scales=stored[1], xpack=planes)
    with pytest.raises(GraphDSLError, match=r"group must be a power of two >= 8 dividing K = 256, got 96"):
        pack_int4_activations(x, 96)
    with pytest.raises(GraphDSLError, match=r"one row \[K\] or \[1, K\].*\[2, 256\]"):
        pack_int4_activations(x.expand(2, 256), 128)
    with pytest.raises(GraphDSLError, match=r"out must be a contiguous int32 \[6, 32\], got torch.int64 \[6, 32\]"):
        pack_int4_activations(x, 128, out=torch.zeros(6, 32, dtype=torch.int64, device=DEV))
    with pytest.raises(GraphDSLError, match=r"perm must be a contiguous int32 \[256\] on .*, got torch.int64 \[256\]"):
        pack_int4_activations(x, 128, perm=torch.arange(256, device=DEV))
    with pytest.raises(GraphDSLError, match=r"gemv: perm is for int4 weights whose activations are not packed"):
        gemv(x, stored[0], scheme=s, scales=stored[1], xpack=planes,
             perm=torch.arange(256, dtype=torch.int32, device=DEV))
    float_loop = dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=2, INT_DOT=False)
    with pytest.raises(GraphDSLError, match=r"xpack needs the one-row integer-dot loop.*'INT_DOT': False"):
        gemv(x, stored[0], scheme=s, scales=stored[1], xpack=planes, config=float_loop)


@pytest.mark.parametrize("pack", [True, False])
def test_one_row_of_int4_gate_up_packs_its_activations_first(pack, monkeypatch):
    """The backend packs a one-row int4 gate/up projection's input with one launch before the GEMV
    (``_XPACK_GATE_UP``, for weights of ``_XPACK_MIN_WEIGHTS`` codes or more); the down projection
    keeps the GEMV's own packing. Equal to the torch backend's reference either way."""
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    from graphdsl.runtime.backends import triton_backend
    from graphdsl.runtime.kernels import int4_acts
    monkeypatch.setattr(triton_backend, "_XPACK_GATE_UP", pack)
    monkeypatch.setattr(triton_backend, "_XPACK_MIN_WEIGHTS", 256 * 128)     # this test's gate/up size
    calls = []
    real = int4_acts.pack_int4_activations
    monkeypatch.setattr(int4_acts, "pack_int4_activations", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    s = parse_scheme("int4-g64")
    with Network("mlp") as net:
        x = Tensor("x", (1, 128), torch.bfloat16)
        gu = Parameter((256, 128), torch.bfloat16, name="gate_up.weight").quantize(s)
        down = Parameter((128, 128), torch.bfloat16, name="down.weight").quantize(s)
        g, u = F.split(F.linear(x, gu, None, transpose_b=True), 2, dim=-1)
        net.mark_output(F.linear(F.silu(g) * u, down, None, transpose_b=True) + x, "y")
    gen = torch.Generator().manual_seed(0)
    feed = {"x": torch.randn(1, 128, generator=gen).to(DEV, torch.bfloat16)}
    for p, shape in ((gu, (256, 128)), (down, (128, 128))):
        feed.update({c.name: t.to(DEV) for c, t in zip(p.companions(), s.quantize(torch.randn(*shape, generator=gen),
                                                                                      torch.bfloat16))})
    got = net.build_engine(device=DEV, backend="triton").forward(feed)["y"]
    want = net.build_engine(device=DEV, backend="torch").forward(feed)["y"]
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * want.float().abs().max().item(), rtol=3e-2)
    assert calls == ([torch.Size([1, 128])] if pack else [])
