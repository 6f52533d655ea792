"""torch habits on graph tensors: the same function runs eagerly on torch tensors and records on
graphdsl tensors (methods such as .T/.t()/.relu(), and torch functions through __torch_function__);
the engine's result equals torch's. torch functions without a graphdsl op raise naming the function."""
import pytest
import torch
import torch.nn.functional as TF

import graphdsl as gd
from graphdsl import Network, Tensor, functional as F

CASES = {
    "x.T": lambda x, v, W: x.T,
    "x.mT": lambda x, v, W: x.mT,
    "x.t()": lambda x, v, W: x.t(),
    "x.relu()": lambda x, v, W: x.relu(),
    "torch.relu": lambda x, v, W: torch.relu(x),
    "TF.relu": lambda x, v, W: TF.relu(x),
    "TF.silu": lambda x, v, W: TF.silu(x),
    "TF.gelu": lambda x, v, W: TF.gelu(x),
    "TF.gelu tanh": lambda x, v, W: TF.gelu(x, approximate="tanh"),
    "torch.sigmoid + tanh + exp": lambda x, v, W: torch.sigmoid(x) + torch.tanh(x) + torch.exp(x),
    "torch.sqrt, rsqrt of exp": lambda x, v, W: torch.sqrt(torch.exp(x)) * torch.rsqrt(torch.exp(x)),
    "torch.neg, x.neg()": lambda x, v, W: torch.neg(x) - x.neg(),
    "torch.add alpha": lambda x, v, W: torch.add(x, v, alpha=2),
    "x.sub, mul, div": lambda x, v, W: x.sub(1.5).mul(v).div(3.0),
    "torch.div, pow": lambda x, v, W: torch.pow(torch.div(x, 2.0), 2),
    "torch.softmax": lambda x, v, W: torch.softmax(x, -1),
    "TF.softmax dim=0": lambda x, v, W: TF.softmax(x, dim=0),
    "torch.sum dim": lambda x, v, W: torch.sum(x, dim=-1),
    "torch.mean keepdim": lambda x, v, W: torch.mean(x, dim=0, keepdim=True),
    "torch.amax": lambda x, v, W: torch.amax(x, dim=1),
    "torch.max(x, dim) values": lambda x, v, W: torch.max(x, 1)[0],
    "torch.max(x, dim) indices": lambda x, v, W: torch.max(x, 1)[1],
    "torch.argmax, x.argmax": lambda x, v, W: torch.argmax(x, dim=-1) + x.argmax(0).sum(),
    "torch.topk": lambda x, v, W: torch.topk(x, 2)[0],
    "torch.cat": lambda x, v, W: torch.cat([x, x * 2], dim=-1),
    "torch.split by size": lambda x, v, W: torch.split(x, 4, dim=1)[1],
    "x.split by sizes": lambda x, v, W: x.split([2, 4], dim=1)[0],
    "x.chunk": lambda x, v, W: x.chunk(2, dim=1)[1],
    "torch.flatten": lambda x, v, W: torch.flatten(x.unsqueeze(0), 1),
    "torch.where": lambda x, v, W: torch.where(x > 0, x, x * 0.5),
    "torch.transpose, reshape, permute": lambda x, v, W: torch.permute(torch.reshape(torch.transpose(x, 0, 1), (3, 2, 5)),
                                                                      (2, 0, 1)),
    "torch.unsqueeze, squeeze": lambda x, v, W: torch.squeeze(torch.unsqueeze(x, 1), 1),
    "torch.matmul": lambda x, v, W: torch.matmul(x, x.T),
    "TF.linear [out, in]": lambda x, v, W: TF.linear(x, W),
    "TF.linear + bias": lambda x, v, W: TF.linear(x, W, W[:, 0]),
    "TF.rms_norm": lambda x, v, W: TF.rms_norm(x, (6,), v, eps=1e-6),
    "TF.layer_norm": lambda x, v, W: TF.layer_norm(x, (6,), v, v * 0.5),
    "x.type_as, view_as, expand_as": lambda x, v, W: x.type_as(v).view_as(x) + v.expand_as(x),
    "x.flatten": lambda x, v, W: x.flatten(),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_records_what_torch_computes(name):
    fn = CASES[name]
    torch.manual_seed(0)
    x, v, W = torch.randn(5, 6), torch.randn(6), torch.randn(4, 6)
    want = fn(x, v, W)
    with Network("habits") as net:
        out = fn(Tensor("x", (5, 6), "float32"), Tensor("v", (6,), "float32"), Tensor("W", (4, 6), "float32"))
        net.mark_output(out, "y")
    engine = net.build_engine()
    got = engine.forward({k: t for k, t in {"x": x, "v": v, "W": W}.items() if k in engine.input_names})["y"]
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dim_is_a_method_as_in_torch():
    t = Tensor("x", (2, 3), "float32")
    assert t.dim() == t.ndim == 2


@pytest.mark.parametrize("call, names", [
    (lambda x: torch.erf(x), "torch.erf() has no graphdsl op"),
    (lambda x: torch.abs(x), "torch.abs() has no graphdsl op"),
    (lambda x: TF.dropout(x, 0.1), "torch.nn.functional.dropout() has no graphdsl op"),
    (lambda x: torch.max(x, x), "torch.max(a, b) (elementwise maximum) has no graphdsl op"),
    (lambda x: torch.add(x, x, out=x), "torch.add: out="),
    (lambda x: TF.relu(x, inplace=True), "torch.nn.functional.relu: inplace=True is not supported"),
    (lambda x: torch.div(x, 2.0, rounding_mode="floor"), "torch.div: rounding_mode='floor' is not supported"),
    (lambda x: x.t().t().unsqueeze(0).t(), "t() / .T expects a tensor of rank <= 2"),
    (lambda x: x.unsqueeze(0).T, "use .mT (the last two dims) or permute(...)"),
])
def test_torch_functions_without_an_op_name_the_function_and_the_line(call, names):
    with Network("bad"):
        with pytest.raises(gd.GraphDSLError) as e:
            call(Tensor("x", (5, 6), "float32"))
    assert names in str(e.value) and "test_torch_habits.py:" in str(e.value)


def test_seed_linear_keeps_x_at_weight_and_suggests_transpose_b_for_torch_layout():
    with Network("lin") as net:
        x = Tensor("x", (5, 6), "float32")
        net.mark_output(F.linear(x, Tensor("w", (6, 4), "float32")), "y")            # seed: w is [in, out]
        with pytest.raises(gd.ShapeError) as e:
            F.linear(x, Tensor("w_t", (4, 6), "float32"))                         # torch layout [out, in]
    msg = str(e.value)
    assert "pass transpose_b=True" in msg and "[5, 6] @ weight [4, 6]" in msg and "test_torch_habits.py:" in msg
    x_, w_ = torch.randn(5, 6), torch.randn(6, 4)
    torch.testing.assert_close(net.build_engine().forward({"x": x_, "w": w_})["y"], x_ @ w_)
    with Network("lin2"):
        with pytest.raises(gd.ShapeError, match=r"matmul: inner dims differ") as e:      # no torch-layout hint
            F.linear(Tensor("x", (5, 6), "float32"), Tensor("w", (3, 7), "float32"))
        assert "transpose_b" not in str(e.value)


@pytest.mark.parametrize("call, what", [
    (lambda x: x.to("cuda"), "to('cuda')"), (lambda x: x.to("cpu", torch.float16), "to('cpu')"),
    (lambda x: x.to(torch.device("cpu")), "to(device(type='cpu'))"), (lambda x: x.to(0), "to(0)"),
    (lambda x: x.to(device="cuda:1"), "to('cuda:1')"), (lambda x: x.cuda(), ".cuda()"), (lambda x: x.cpu(), ".cpu()"),
])
def test_devices_on_graph_tensors_say_there_are_none(call, what):
    with Network("dev"):
        with pytest.raises(gd.GraphDSLError) as e:
            call(Tensor("x", (5, 6), "float32"))
    msg = str(e.value)
    assert msg.startswith(f"{what} on graph tensor 'x' at ") and "test_torch_habits.py:" in msg
    assert "graph tensors have no device" in msg


def test_to_takes_dtypes_as_torch_does():
    with Network("to"):
        x = Tensor("x", (5, 6), "float32")
        assert x.to(torch.float16).dtype == torch.float16 and x.to("bfloat16").dtype == torch.bfloat16
        assert x.to(dtype=torch.float64).dtype == torch.float64 and x.to(x.to("float16")).dtype == torch.float16
        with pytest.raises(gd.GraphDSLError, match="needs a dtype"):
            x.to()
