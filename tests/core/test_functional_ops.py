"""Differential tests of every op in ``graphdsl.functional`` against independent plain-torch math.

Each test records op(s) on declared fake tensors, builds an engine, runs it on random torch
inputs and compares with the expected value written here (never the op's own ``reference``).
:func:`check_op` also checks, for every run:

* the record-time shape (evaluated under the call's dim values) and dtype of each output equal
  those of the expected tensor;
* every node's torch reference, run node by node, returns exactly the shape/dtype its shape rule
  promised (the engine copies results into planned buffers, which would hide a mismatch);
* ``mode="symbolic"`` declares the sizes as :class:`~graphdsl.Dim` s and runs two different sizes
  through the *same* engine; ``mode="static"`` builds one engine per size (sizes 1 and 7).

Tolerances are per dtype (float32 ~1e-5 relative, float16 ~2 ulp, bfloat16 ~2 ulp).
"""
from __future__ import annotations

import math
import operator
import re
import zlib
from pathlib import Path

import pytest
import torch

from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F
from graphdsl.dim import DimExpr, evaluate, evaluate_shape
from graphdsl.errors import BindError, GraphDSLError, ShapeError

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
MODES = {"static": ({"n": 1}, {"n": 7}), "symbolic": ({"n": 3}, {"n": 33})}
BOTH = list(MODES)


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the test id."""
    torch.random.default_generator.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def randn(*shape, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(shape, dtype=torch.float64) * scale + shift).to(dtype)


def rand_any(shape, dtype):
    """Random values of any dtype: normal floats, ints in [-9, 9], random bools."""
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(-9, 10, shape, dtype=dtype)
    return randn(*shape, dtype=dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0, what: str = ""):
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != expected {want.dtype}"
    if want.dtype.is_floating_point:
        tol = TOL[want.dtype] * scale
        g, w = got.double(), want.double()
        if not bool(((g - w).abs() <= tol + tol * w.abs()).all()):   # fast path; the message from torch
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what}: {got} != expected {want}"


def _extent(s, dims):
    if isinstance(s, str):
        return dims[s]
    return s(dims) if callable(s) else s


def _resolve(v, binding):
    if isinstance(v, DimExpr):
        return evaluate(v, binding)
    if isinstance(v, tuple):
        return tuple(_resolve(x, binding) for x in v)
    return v


def record(graph, decl: dict, dims: dict):
    """Record ``graph(**inputs)`` with inputs declared by ``decl`` (name -> (shape template, dtype));
    shape entries are ints, dim names (looked up in ``dims``) or callables of ``dims``."""
    with Network("test") as net:
        ins = {name: Tensor(name, tuple(_extent(s, dims) for s in shape), dtype)
               for name, (shape, dtype) in decl.items()}
        outs = graph(**ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for i, t in enumerate(outs):
            net.mark_output(t, f"out{i}")
    return net, outs


def check_reference_specs(net: Network, feeds: dict, binding: dict):
    """Run each node's torch reference in order; its results must have the rule's shape/dtype."""
    vals = {t: feeds[name].clone() for name, t in net.inputs.items()}
    assert vals, "the graph reads no input" 
    for node in net.nodes:
        attrs = {k: _resolve(v, binding) for k, v in node.attrs.items()}
        res = node.opdef.run([vals[t] for t in node.inputs], attrs)
        assert len(res) == len(node.outputs), f"{node.op}: {len(res)} results for {len(node.outputs)} outputs"
        for t, r in zip(node.outputs, res):
            rule = (evaluate_shape(t.shape, binding), t.dtype)
            assert (tuple(r.shape), r.dtype) == rule, (
                f"node {node.name} ({node.op}, attrs {attrs}): reference returns {tuple(r.shape)} {r.dtype}, "
                f"shape rule says {rule[0]} {rule[1]}")
            vals[t] = r


def check_op(graph, decl: dict, make, expect, mode: str = "static", sizes=None, scale: float = 1.0):
    """Record ``graph`` over inputs ``decl``; for each sizes dict, feed ``make(sizes)`` and compare
    every output with ``expect(**feeds)`` (record-time shape/dtype and values). Returns the
    per-run ``(engine, feeds, outputs)``."""
    sizes = list(sizes or MODES[mode])
    if mode == "symbolic":
        names = {n for sz in sizes for n in sz}
        net, outs = record(graph, decl, {n: Dim(n) for n in names})
        engine = net.build_engine()
        runs = [(net, engine, outs, sz) for sz in sizes]
    else:
        runs = []
        for sz in sizes:
            net, outs = record(graph, decl, sz)
            runs.append((net, net.build_engine(), outs, sz))
    results = []
    for net, engine, outs, sz in runs:
        feeds = make(sz)
        check_reference_specs(net, feeds, sz)
        got = engine.forward({k: v.clone() for k, v in feeds.items() if k in net.inputs})
        want = expect(**feeds)
        want = want if isinstance(want, tuple) else (want,)
        assert len(want) == len(outs)
        for i, (rec, w) in enumerate(zip(outs, want)):
            what = f"output {i} at sizes {sz}"
            assert evaluate_shape(rec.shape, sz) == tuple(w.shape), \
                f"{what}: record-time shape {rec.shape} != actual {tuple(w.shape)}"
            assert rec.dtype == w.dtype, f"{what}: record-time dtype {rec.dtype} != actual {w.dtype}"
            assert_close(got[f"out{i}"], w, scale, what)
        results.append((engine, feeds, got))
    return results


def dt_id(d) -> str:
    return str(d).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# pointwise: binary arithmetic, scalars, promotion
# ---------------------------------------------------------------------------------------------
BINARY = {  # name -> (graph op, float64 formula)
    "add": (F.add, lambda a, b: a + b),
    "sub": (F.sub, lambda a, b: a - b),
    "mul": (F.mul, lambda a, b: a * b),
    "div": (F.div, lambda a, b: a / b),
    "pow": (F.pow, lambda a, b: torch.exp(b * torch.log(a))),
}
OPERATORS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
             "pow": operator.pow}
BCAST = [(("n", 5), ("n", 5)), (("n", 1, 7), (3, 7)), ((5,), ("n", 1)), (("n", 4), ())]


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("shapes", BCAST, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_arith(name, dtype, shapes, mode):
    # static graphs are recorded through F.<op>, symbolic ones through the Python operator
    op = BINARY[name][0] if mode == "static" else OPERATORS[name]
    formula = BINARY[name][1]
    sa, sb = shapes

    def make(sz):
        a = randn(*[_extent(s, sz) for s in sa], dtype=dtype)
        b = randn(*[_extent(s, sz) for s in sb], dtype=dtype)
        if name == "pow":
            a = a.abs() + 0.5
            b = b.clamp(-2, 2)
        if name == "div":
            b = torch.where(b.abs() < 0.25, torch.full_like(b, 0.75), b)
        return {"a": a, "b": b}

    def expect(a, b):
        return formula(a.double(), b.double()).to(dtype)

    check_op(lambda a, b: op(a, b), {"a": (sa, dtype), "b": (sb, dtype)}, make, expect, mode,
             scale=4.0 if name == "pow" else 1.0)


PROMOTE = [(torch.float16, torch.float32), (torch.bfloat16, torch.float16), (torch.int32, torch.float16),
           (torch.int32, torch.int64), (torch.bool, torch.int32), (torch.bool, torch.bfloat16),
           (torch.int64, torch.bool)]


@pytest.mark.parametrize("name,dts", [(n, d) for n in ["add", "sub", "mul", "div"] for d in PROMOTE
                                      if not (n == "sub" and torch.bool in d)],   # torch rejects bool - x
                         ids=lambda p: p if isinstance(p, str) else f"{dt_id(p[0])}-{dt_id(p[1])}")
@pytest.mark.parametrize("zero_d", [None, "a", "b"])
def test_binary_promotion(name, dts, zero_d):
    """Mixed dtypes follow torch's promotion, including the 'weak' 0-d operand rule."""
    da, db = dts
    sa = () if zero_d == "a" else (3, 4)
    sb = () if zero_d == "b" else (4,)

    def make(sz):
        b = rand_any(sb, db)
        if name == "div":            # no zero divisors
            b = torch.ones(sb, dtype=db) if db == torch.bool else torch.where(b == 0, torch.ones_like(b), b)
        return {"a": rand_any(sa, da), "b": b}

    torch_op = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[name]
    check_op(lambda a, b: BINARY[name][0](a, b), {"a": (sa, da), "b": (sb, db)}, make,
             lambda a, b: torch_op(a, b), sizes=[{}])


# name -> (graph expression, the same in torch)
SCALAR_CASES = {
    "x+s": (lambda x, s: x + s, lambda x, s: x + s),
    "s+x": (lambda x, s: s + x, lambda x, s: s + x),
    "x-s": (lambda x, s: x - s, lambda x, s: x - s),
    "s-x": (lambda x, s: s - x, lambda x, s: s - x),
    "x*s": (lambda x, s: x * s, lambda x, s: x * s),
    "s*x": (lambda x, s: s * x, lambda x, s: s * x),
    "x/s": (lambda x, s: x / s, lambda x, s: x / s),
    "s/x": (lambda x, s: s / x, lambda x, s: s / x),
    "x**s": (lambda x, s: x ** s, lambda x, s: x ** s),
    "F.pow(s,x)": (lambda x, s: F.pow(s, x), lambda x, s: torch.pow(s, x)),
    "F.sub(s,x)": (lambda x, s: F.sub(s, x), lambda x, s: s - x),
    "F.mul(x,s)": (lambda x, s: F.mul(x, s), lambda x, s: x * s),
}


@pytest.mark.parametrize("value", [3, 0.1, -2], ids=str)
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32], ids=dt_id)
@pytest.mark.parametrize("case", list(SCALAR_CASES))
def test_scalar_operand(case, dtype, value):
    """Python numbers on either side act as torch's weak scalars (dtype of the tensor operand,
    float32 for a float next to an integer tensor)."""
    graph_fn, torch_fn = SCALAR_CASES[case]
    if case == "x**s" and value == -2 and not dtype.is_floating_point:
        value = 2                        # torch rejects integers to negative integer powers
    if case == "F.pow(s,x)" and value == -2:
        value = 2.5                      # a negative base to non-integer powers is NaN

    def make(sz):
        x = rand_any((sz["n"], 5), dtype)
        if not dtype.is_floating_point:
            x = x.abs() + 1               # no zero divisors, no negative bases
        elif "pow" in case or "**" in case:
            x = x.abs() + 0.5 if case == "x**s" else x.clamp(-3, 3)
        else:
            x = torch.where(x.abs() < 0.25, torch.full_like(x, 0.5), x)
        return {"x": x}

    check_op(lambda x: graph_fn(x, value), {"x": (("n", 5), dtype)}, make, lambda x: torch_fn(x, value),
             "symbolic", scale=4.0)


def test_scalar_base_pow_operator():
    check_op(lambda x: 2 ** x, {"x": ((3,), torch.float32)}, lambda sz: {"x": randn(3)},
             lambda x: 2 ** x, "static")


@pytest.mark.parametrize("like", [torch.bool, torch.int32, torch.float16, torch.bfloat16, torch.float32], ids=dt_id)
@pytest.mark.parametrize("value", [5, -3, 2.5])
def test_scalar(like, value):
    """F.scalar: a 0-d constant whose dtype follows torch's rule for ``like + value``."""
    want_dtype = (torch.tensor(0, dtype=like) + value).dtype  # torch's dtype for a weak scalar next to like

    def expect(x):
        return torch.full((), value, dtype=torch.float64).to(want_dtype)

    check_op(lambda x: F.scalar(x, value=value), {"x": (("n", 2), like)},
             lambda sz: {"x": rand_any((sz["n"], 2), like)}, expect, "symbolic")


# ---------------------------------------------------------------------------------------------
# pointwise: unary ops and activations
# ---------------------------------------------------------------------------------------------
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


UNARY = {  # name -> (graph fn, float64 formula, positive inputs only)
    "neg": (F.neg, lambda x: -x, False),
    "exp": (F.exp, lambda x: math.e ** x, False),
    "sqrt": (F.sqrt, lambda x: x ** 0.5, True),
    "rsqrt": (F.rsqrt, lambda x: 1.0 / x ** 0.5, True),
    "sigmoid": (F.sigmoid, lambda x: 1.0 / (1.0 + math.e ** (-x)), False),
    "tanh": (F.tanh, lambda x: (math.e ** (2 * x) - 1) / (math.e ** (2 * x) + 1), False),
    "silu": (F.silu, lambda x: x / (1.0 + math.e ** (-x)), False),
    "gelu": (F.gelu, _gelu, False),
    "gelu_tanh": (F.gelu_tanh, _gelu_tanh, False),
    "relu": (F.relu, lambda x: x * (x > 0), False),
}


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32], ids=dt_id)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name, dtype, mode):
    graph_fn, formula, positive = UNARY[name]
    keeps_int = name in ("neg", "relu")
    out_dtype = dtype if dtype.is_floating_point or keeps_int else torch.float32

    def make(sz):
        x = rand_any((sz["n"], 3, 5), dtype)
        if positive:
            x = x.abs() + (1 if not dtype.is_floating_point else 0.05)
        return {"x": x}

    check_op(graph_fn, {"x": (("n", 3, 5), dtype)}, make, lambda x: formula(x.double()).to(out_dtype), mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dt_id)
def test_unary_methods_and_operators(dtype):
    """Tensor methods / operators record the same ops: -x, exp, sqrt, rsqrt, sigmoid, tanh, pow, softmax."""
    def graph(x):
        p = x * x + 0.5
        return -x, x.exp(), p.sqrt(), p.rsqrt(), x.sigmoid(), x.tanh(), x.pow(2), x.softmax(-1)

    def expect(x):
        x = x.double()
        p = (x * x).to(dtype).double() + 0.5             # the graph rounds x*x to dtype first
        e = math.e ** (x - x.max(-1, keepdim=True).values)
        outs = (-x, math.e ** x, p ** 0.5, p ** -0.5, 1 / (1 + math.e ** -x),
                (math.e ** (2 * x) - 1) / (math.e ** (2 * x) + 1), x * x, e / e.sum(-1, keepdim=True))
        return tuple(o.to(dtype) for o in outs)

    check_op(graph, {"x": (("n", 6), dtype)}, lambda sz: {"x": randn(sz["n"], 6, dtype=dtype)}, expect, "symbolic",
             scale=2.0)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
@pytest.mark.parametrize("act", list(F.ActType), ids=lambda a: a.name)
def test_activation(act, dtype, mode):
    gated = act in (F.ActType.SWIGLU, F.ActType.GEGLU)
    width = 14 if gated else 7
    formulas = {F.ActType.SILU: lambda x: x / (1 + math.e ** -x), F.ActType.GELU: _gelu,
                F.ActType.GELU_TANH: _gelu_tanh, F.ActType.RELU: lambda x: x.clamp_min(0),
                F.ActType.SIGMOID: lambda x: 1 / (1 + math.e ** -x)}

    def expect(x):
        x = x.double()
        if not gated:
            return formulas[act](x).to(dtype)
        gate, up = x[..., :7], x[..., 7:]
        # the graph rounds the activated gate to `dtype` before multiplying by `up`
        g = (gate / (1 + math.e ** -gate) if act is F.ActType.SWIGLU else _gelu_tanh(gate)).to(dtype).double()
        return (g * up).to(dtype)

    check_op(lambda x: F.activation(x, act), {"x": (("n", width), dtype)},
             lambda sz: {"x": randn(sz["n"], width, dtype=dtype, scale=2.0)}, expect, mode)


def test_activation_rejects_strings():
    with Network():
        x = Tensor("x", (2, 4), torch.float32)
        with pytest.raises(GraphDSLError, match=r"act must be an ActType, one of \['SILU', .*'GEGLU'\], got 'silu'"):
            F.activation(x, "silu")


# ---------------------------------------------------------------------------------------------
# pointwise: where, cast, comparisons
# ---------------------------------------------------------------------------------------------
WHERE_CASES = {  # graph fn, torch fn, (cond, a, b) shape templates
    "tensors": (lambda c, a, b: F.where(c, a, b), lambda c, a, b: torch.where(c, a, b),
                (("n", 1), ("n", 5), (5,))),
    "scalar_b": (lambda c, a, b: F.where(c, a, -1.5), lambda c, a, b: torch.where(c, a, -1.5),
                 (("n", 5), ("n", 5), (5,))),
    "scalar_a": (lambda c, a, b: F.where(c, 2.5, b), lambda c, a, b: torch.where(c, 2.5, b),
                 (("n", 5), (5,), ("n", 5))),
    "int_scalar": (lambda c, a, b: F.where(c, a, -3), lambda c, a, b: torch.where(c, a, -3),
                   (("n", 5), ("n", 5), (5,))),
    "cond_from_compare": (lambda c, a, b: F.where(a > b, a, b), lambda c, a, b: torch.maximum(a, b),
                          (("n", 5), ("n", 5), ("n", 5))),
}


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32], ids=dt_id)
@pytest.mark.parametrize("case", list(WHERE_CASES))
def test_where(case, dtype, mode):
    graph_fn, torch_fn, (sc, sa, sb) = WHERE_CASES[case]

    def make(sz):
        shp = lambda s: tuple(_extent(e, sz) for e in s)
        return {"c": torch.rand(shp(sc)) < 0.5, "a": rand_any(shp(sa), dtype), "b": rand_any(shp(sb), dtype)}

    decl = {"c": (sc, torch.bool), "a": (sa, dtype), "b": (sb, dtype)}   # scalar cases leave one unused
    check_op(graph_fn, decl, make, torch_fn, mode)


def test_where_rejects_non_bool_cond():
    with Network():
        c, a = Tensor("c", (3,), torch.float32), Tensor("a", (3,), torch.float32)
        with pytest.raises(ShapeError, match=r"where: cond must be bool, got torch\.float32"):
            F.where(c, a, a)


CAST_TARGETS = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool, "bfloat16",
                "half"]


@pytest.mark.parametrize("target,via", [(t, "F.cast") for t in CAST_TARGETS]
                         + [(t, "method") for t in (torch.float32, torch.float16, torch.bfloat16, torch.int64)],
                         ids=str)
@pytest.mark.parametrize("src", FLOATS + [torch.int32, torch.bool], ids=dt_id)
def test_cast(src, target, via):
    want_dtype = {"bfloat16": torch.bfloat16, "half": torch.float16}.get(target, target)
    if via == "method":
        methods = {torch.float32: lambda x: x.float(), torch.float16: lambda x: x.half(),
                   torch.bfloat16: lambda x: x.bfloat16()}
        graph_fn = methods.get(target, lambda x: x.to(target))
    else:
        graph_fn = lambda x: F.cast(x, target)

    def expect(x):
        if want_dtype == torch.bool:
            return x != 0
        if src.is_floating_point and not want_dtype.is_floating_point:
            return x.double().trunc().to(want_dtype)   # C-style truncation toward zero
        return x.double().to(want_dtype)

    def make(sz):
        x = rand_any((sz["n"], 4), src)
        if src.is_floating_point:
            x = (x * 4).to(src)
            x[0, 0] = 0                                   # a false for the bool target
        return {"x": x}

    check_op(graph_fn, {"x": (("n", 4), src)}, make, expect, "symbolic")


def test_cast_rejects_unknown_dtype_name():
    with Network():
        x = Tensor("x", (3,), torch.float32)
        with pytest.raises(GraphDSLError, match=r"cast dtype must be a torch.dtype or one of .*got 'float128'"):
            F.cast(x, "float128")


@pytest.mark.parametrize("mode", BOTH)
def test_transfer(mode):
    """``transfer`` copies to a device (here the host, as ``cpu:1``, a second CPU part): same values."""
    def graph_fn(x):
        return (F.transfer(x * 2.0, device="cpu:1") + 1.0,)

    check_op(graph_fn, {"x": (("n", 4), torch.float32)}, lambda sz: {"x": torch.randn(sz["n"], 4)},
             lambda x: x * 2.0 + 1.0, mode)


@pytest.mark.parametrize("act", [F.ActType.SWIGLU, F.ActType.GEGLU])
def test_moe_experts(act):
    """``moe_experts`` against a per-token loop over each token's chosen experts."""
    E, H, I = 4, 8, 6

    def graph_fn(x, routing, gate_up, down):
        return (F.moe_experts(x, routing, gate_up, down, act=act, top_k=2),)

    def make(sz):
        scores = torch.rand(sz["n"], E)
        top = scores.topk(2, dim=-1).indices
        routing = torch.zeros_like(scores).scatter(1, top, scores.gather(1, top))
        return {"x": torch.randn(sz["n"], H), "routing": routing, "gate_up": torch.randn(E, 2 * I, H) * 0.3,
                "down": torch.randn(E, H, I) * 0.3}

    def expect(x, routing, gate_up, down):
        fn = torch.nn.functional.silu if act is F.ActType.SWIGLU else \
            (lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e in routing[t].nonzero().flatten().tolist():
                g, u = (gate_up[e] @ x[t]).chunk(2)
                out[t] += routing[t, e] * (down[e] @ (fn(g) * u))
        return out

    check_op(graph_fn, {"x": (("n", H), torch.float32), "routing": (("n", E), torch.float32),
                        "gate_up": ((E, 2 * I, H), torch.float32), "down": ((E, H, I), torch.float32)},
             make, expect, "symbolic", scale=10.0)


COMPARE = {"lt": (F.lt, operator.lt), "le": (F.le, operator.le), "gt": (F.gt, operator.gt),
           "ge": (F.ge, operator.ge), "eq": (F.eq, operator.eq), "ne": (F.ne, operator.ne)}


@pytest.mark.parametrize("name,rhs", [(n, r) for n in COMPARE for r in ["tensor", "scalar", "scalar_left", "operator"]
                                      if not (r == "operator" and n in ("eq", "ne"))])  # Tensor == is identity
@pytest.mark.parametrize("dtype", FLOATS + [torch.int64], ids=dt_id)
def test_compare(name, dtype, rhs):
    mode = "static" if rhs == "tensor" else "symbolic"
    fop, pyop = COMPARE[name]
    s = 2 if not dtype.is_floating_point else 0.5

    def make(sz):
        a = rand_any((sz["n"], 6), dtype)
        b = rand_any((6,), dtype)
        # every row holds a tie, a larger and a smaller value than the other operand
        ref = b if rhs in ("tensor", "operator") else torch.full_like(b, s)
        a[:, 0::3], a[:, 1::3], a[:, 2::3] = ref[0::3], ref[1::3] + 1, ref[2::3] - 1
        return {"a": a, "b": b}

    graph_fn = {"tensor": lambda a, b: fop(a, b), "scalar": lambda a, b: fop(a, s),
                "scalar_left": lambda a, b: fop(s, a), "operator": lambda a, b: pyop(a, b)}[rhs]

    def expect(a, b):
        a, b = a.double(), b.double()
        if rhs == "scalar":
            return pyop(a, s)
        if rhs == "scalar_left":
            return pyop(torch.full_like(a, s), a)
        return pyop(a, b)

    results = check_op(graph_fn, {"a": (("n", 6), dtype), "b": ((6,), dtype)}, make, expect, mode)
    for _, _, got in results:
        out = got["out0"]
        assert out.any() and not out.all(), "comparison inputs should give both outcomes"


# ---------------------------------------------------------------------------------------------
# reductions and row ops
# ---------------------------------------------------------------------------------------------
REDUCE_DIMS = ([(d, k, "symbolic") for d in (None, 0, -1, 1, (0, 2)) for k in (False, True)]
               + [(None, False, "static"), (-1, True, "static"), ((0, 2), False, "static")])


@pytest.mark.parametrize("dim,keepdim,mode", REDUCE_DIMS, ids=str)
@pytest.mark.parametrize("name,dtype", [(n, d) for n in ("sum", "mean", "max")
                                        for d in FLOATS + [torch.int32] + ([torch.bool] if n != "max" else [])]
                         + [("sum_method", torch.float32), ("mean_method", torch.bfloat16), ("max_method", torch.int32)],
                         ids=str)
def test_reduce(name, dtype, dim, keepdim, mode):
    base = name.removesuffix("_method")
    if name.endswith("_method"):
        graph_fn = lambda x: getattr(x, base)(dim, keepdim)
    else:
        fop = {"sum": F.sum, "mean": F.mean, "max": F.max}[base]
        graph_fn = lambda x: fop(x, dim=dim, keepdim=keepdim)
    if base == "sum":   # torch: integer and bool sums are int64
        out_dtype = dtype if dtype.is_floating_point else torch.int64
    elif base == "mean":
        out_dtype = dtype if dtype.is_floating_point else torch.float32
    else:
        out_dtype = dtype

    def expect(x):
        dims = tuple(range(x.ndim)) if dim is None else dim
        dims = tuple(d % x.ndim for d in (dims if isinstance(dims, tuple) else (dims,)))
        y = x.double()
        for d in sorted(dims, reverse=True):
            if base == "sum":
                y = y.sum(d, keepdim=True)
            elif base == "mean":
                y = y.sum(d, keepdim=True) / x.shape[d]
            else:
                y = y.max(d, keepdim=True).values
        if not keepdim:
            y = y.reshape([s for i, s in enumerate(y.shape) if i not in dims])
        return y.to(out_dtype)

    scale = 1.0 if base == "max" else (4.0 if dtype == torch.float32 else 2.0)   # summation order
    check_op(graph_fn, {"x": (("n", 4, 6), dtype)}, lambda sz: {"x": rand_any((sz["n"], 4, 6), dtype)},
             expect, mode, scale=scale)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
@pytest.mark.parametrize("via", ["F", "method"])
def test_softmax(dtype, dim, mode, via):
    def expect(x):
        x = x.double()
        e = math.e ** (x - x.max(dim, keepdim=True).values)
        return (e / e.sum(dim, keepdim=True)).to(dtype)

    graph_fn = (lambda x: F.softmax(x, dim)) if via == "F" else (lambda x: x.softmax(dim))
    check_op(graph_fn, {"x": (("n", 5, 7), dtype)}, lambda sz: {"x": randn(sz["n"], 5, 7, dtype=dtype, scale=3.0)},
             expect, mode)


def _first_argmax(x: torch.Tensor, dim, keepdim):
    """Index of the first maximum, without torch.argmax."""
    if dim is None:
        idx = _first_argmax(x.reshape(-1), 0, False)
        return idx.reshape([1] * x.ndim) if keepdim else idx
    dim = dim % x.ndim
    is_max = x == x.max(dim, keepdim=True).values
    pos = torch.arange(x.shape[dim]).reshape([-1 if i == dim else 1 for i in range(x.ndim)]).expand(x.shape)
    big = torch.full_like(pos, x.shape[dim])
    return torch.where(is_max, pos, big).min(dim, keepdim=keepdim).values


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [-1, 0, 1, None], ids=str)
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32], ids=dt_id)
def test_argmax(dtype, dim, keepdim, mode):
    def make(sz):
        x = rand_any((sz["n"], 4, 9), dtype)
        x[..., 7] = x.max()              # ties: the first maximum wins
        return {"x": x}

    check_op(lambda x: F.argmax(x, dim=dim, keepdim=keepdim), {"x": (("n", 4, 9), dtype)}, make,
             lambda x: _first_argmax(x, dim, keepdim), mode)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("k_dim", [(1, -1), (3, -1), (7, 1), (1, 0), (2, 0)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS + [torch.int64], ids=dt_id)
def test_topk(dtype, k_dim, mode):
    k, dim = k_dim
    sizes = ({"n": 2}, {"n": 7}) if mode == "static" else None   # k=2 along dim 0 needs n >= 2

    def make(sz):
        # distinct values (exact in bf16: |v| <= 116/4), so the indices are unique too
        x = (torch.randperm(sz["n"] * 7).reshape(sz["n"], 7) - 116).double() / 4
        return {"x": x.to(dtype) if dtype.is_floating_point else (x * 4).to(dtype)}

    def expect(x):
        # sorting is a different algorithm from topk: the k largest, descending, and where they were
        order = x.double().argsort(dim, descending=True).narrow(dim, 0, k)
        return x.gather(dim, order), order

    check_op(lambda x: F.topk(x, k=k, dim=dim), {"x": (("n", 7), dtype)}, make, expect, mode, sizes)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("shape", [("n", 33), (2, "n", 16)], ids=str)
@pytest.mark.parametrize("wdtype", ["same", torch.float32], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_rms_norm(dtype, wdtype, shape, mode):
    """Against HF LlamaRMSNorm.forward, written out (default eps 1e-6 static, eps=0.01 symbolic)."""
    wdtype = dtype if wdtype == "same" else wdtype
    eps = 1e-6 if mode == "static" else 1e-2
    hidden = shape[-1]

    def hf_llama_rms_norm(x, w):
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return w * h.to(input_dtype)

    def make(sz):
        return {"x": randn(*[_extent(s, sz) for s in shape], dtype=dtype, scale=3.0, shift=0.5),
                "w": randn(hidden, dtype=wdtype, scale=0.5, shift=1.0)}

    graph = (lambda x, w: F.rms_norm(x, w, eps=eps)) if eps != 1e-6 else (lambda x, w: F.rms_norm(x, w))
    check_op(graph, {"x": (shape, dtype), "w": ((hidden,), wdtype)}, make, hf_llama_rms_norm, mode)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_layer_norm(dtype, bias, mode, eps):
    def expect(x, w, b=None):
        x64 = x.double()
        mu = x64.sum(-1, keepdim=True) / x.shape[-1]
        var = ((x64 - mu) ** 2).sum(-1, keepdim=True) / x.shape[-1]   # biased, like torch/HF
        y = (x64 - mu) / (var + eps) ** 0.5 * w.double()
        if b is not None:
            y = y + b.double()
        return y.to(dtype)

    def make(sz):
        feeds = {"x": randn(sz["n"], 3, 33, dtype=dtype, scale=2.0, shift=1.0),
                 "w": randn(33, dtype=dtype, scale=0.5, shift=1.0)}
        if bias:
            feeds["b"] = randn(33, dtype=dtype)
        return feeds

    decl = {"x": (("n", 3, 33), dtype), "w": ((33,), dtype)}
    if bias:
        decl["b"] = ((33,), dtype)
        graph = lambda x, w, b: F.layer_norm(x, w, b, eps=eps)
    else:
        graph = lambda x, w: F.layer_norm(x, w, eps=eps)
    check_op(graph, decl, make, expect, mode)


# ---------------------------------------------------------------------------------------------
# matmul, bmm, linear
# ---------------------------------------------------------------------------------------------
MATMUL_SHAPES = [  # a (untransposed logical), b (logical)
    (("n", 33), (33, 7)),
    ((2, "n", 5), (5, 3)),
    ((3, 1, "n", 4), (2, 4, 6)),
]


def _store(shape, transpose):
    return shape[:-2] + (shape[-1], shape[-2]) if transpose else shape


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("ta,tb,via", [(False, False, "F"), (True, False, "F"), (False, True, "F"), (True, True, "F"),
                                       (False, False, "operator")])
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_matmul(dtype, shapes, ta, tb, mode, via):
    la, lb = shapes
    sa, sb = _store(la, ta), _store(lb, tb)

    def expect(a, b):
        a64, b64 = a.double(), b.double()
        a64 = a64.transpose(-1, -2) if ta else a64
        b64 = b64.transpose(-1, -2) if tb else b64
        out = (a64.unsqueeze(-1) * b64.unsqueeze(-3)).sum(-2)    # Σ_k a[..., m, k] b[..., k, n]
        return out.to(dtype)

    make = lambda sz: {"a": randn(*[_extent(s, sz) for s in sa], dtype=dtype),
                       "b": randn(*[_extent(s, sz) for s in sb], dtype=dtype)}
    graph = (lambda a, b: a @ b) if via == "operator" else (lambda a, b: F.matmul(a, b, transpose_a=ta, transpose_b=tb))
    check_op(graph, {"a": (sa, dtype), "b": (sb, dtype)}, make, expect, mode, scale=4.0)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_bmm(dtype, ta, tb):
    sa = (4, 9, "n") if ta else (4, "n", 9)
    sb = (4, 5, 9) if tb else (4, 9, 5)

    def expect(a, b):
        a = a.double().transpose(1, 2) if ta else a.double()
        b = b.double().transpose(1, 2) if tb else b.double()
        return torch.stack([a[i] @ b[i] for i in range(4)]).to(dtype)

    check_op(lambda a, b: F.bmm(a, b, ta, tb), {"a": (sa, dtype), "b": (sb, dtype)},
             lambda sz: {"a": randn(*[_extent(s, sz) for s in sa], dtype=dtype),
                         "b": randn(*[_extent(s, sz) for s in sb], dtype=dtype)},
             expect, "symbolic", scale=4.0)


@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_lora_apply(dtype):
    """``y[t] + (x[t]·A[s]ᵀ)·B[s]ᵀ`` per token, ``s = indices[t]`` (-1: y unchanged), against a per-row
    float64 loop."""
    def expect(y, x, a, b, idx):
        rows = [y[t].double() + ((b[:, s].double() @ (a[s].double() @ x[t].double())) if s >= 0 else 0)
                for t, s in enumerate(idx.tolist())]
        return torch.stack(rows).to(dtype)

    def make(sz):
        n = sz["n"]
        return {"y": randn(n, 7, dtype=dtype), "x": randn(n, 9, dtype=dtype), "a": randn(3, 4, 9, dtype=dtype),
                "b": randn(7, 3, 4, dtype=dtype),
                "idx": torch.tensor([(t % 4) - 1 for t in range(n)], dtype=torch.int32)}

    check_op(lambda y, x, a, b, idx: F.lora_apply(y, x, a, b, idx),
             {"y": (("n", 7), dtype), "x": (("n", 9), dtype), "a": ((3, 4, 9), dtype), "b": ((7, 3, 4), dtype),
              "idx": (("n",), torch.int32)}, make, expect, "symbolic", scale=4.0)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("hf_layout", [False, True])
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_linear(dtype, hf_layout, bias, mode):
    """Seed semantics: weight is [in, out]; HF's [out, in] with transpose_b=True."""
    wshape = (8, 16) if hf_layout else (16, 8)

    def expect(x, w, b=None):
        w64 = w.double().T if hf_layout else w.double()
        y = torch.einsum("...i,io->...o", x.double(), w64)
        if b is not None:
            # the graph rounds x @ w to dtype, then adds the bias
            y = y.to(dtype).double() + b.double()
        return y.to(dtype)

    decl = {"x": ((2, "n", 16), dtype), "w": (wshape, dtype)}
    if bias:
        decl["b"] = ((8,), dtype)
        graph = lambda x, w, b: F.linear(x, w, b, False, hf_layout)
    else:
        graph = lambda x, w: F.linear(x, w, None, transpose_b=hf_layout)

    def make(sz):
        f = {"x": randn(2, sz["n"], 16, dtype=dtype), "w": randn(*wshape, dtype=dtype, scale=0.3)}
        if bias:
            f["b"] = randn(8, dtype=dtype)
        return f

    check_op(graph, decl, make, expect, mode, scale=4.0)


# ---------------------------------------------------------------------------------------------
# views and data movement
# ---------------------------------------------------------------------------------------------
VIEW_CASES = {  # graph fn on x of shape (n, 4, 6); torch fn
    "reshape_dims": (lambda x: F.reshape(x, (x.shape[0], 24)), lambda x: x.reshape(x.shape[0], 24)),
    "reshape_-1": (lambda x: F.reshape(x, (-1, 6)), lambda x: x.reshape(-1, 6)),
    "reshape_flat": (lambda x: x.reshape(-1), lambda x: x.reshape(-1)),
    "view_split": (lambda x: x.view(x.shape[0], 2, 2, 6), lambda x: x.reshape(x.shape[0], 2, 2, 6)),
    "reshape_mid_-1": (lambda x: x.reshape(x.shape[0], -1, 3), lambda x: x.reshape(x.shape[0], -1, 3)),
    "permute": (lambda x: F.permute(x, (2, 0, 1)), lambda x: x.permute(2, 0, 1)),
    "permute_neg": (lambda x: x.permute(-1, -3, -2), lambda x: x.permute(2, 0, 1)),
    "transpose": (lambda x: F.transpose(x, 0, -1), lambda x: x.transpose(0, 2)),
    "transpose_method": (lambda x: x.transpose(1, 2), lambda x: x.transpose(1, 2)),
    "unsqueeze0": (lambda x: F.unsqueeze(x, dim=0), lambda x: x[None]),
    "unsqueeze-1": (lambda x: x.unsqueeze(-1), lambda x: x[..., None]),
    "unsqueeze2": (lambda x: x.unsqueeze(2), lambda x: x[:, :, None]),
    "squeeze": (lambda x: F.squeeze(F.unsqueeze(x, dim=1), dim=1), lambda x: x),
    "squeeze_neg": (lambda x: x.unsqueeze(-1).squeeze(-1), lambda x: x),
    "contiguous_then_add": (lambda x: x.transpose(0, 1).contiguous() + 1, lambda x: x.transpose(0, 1) + 1),
}


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64], ids=dt_id)
@pytest.mark.parametrize("case", list(VIEW_CASES))
def test_views(case, dtype, mode):
    graph_fn, torch_fn = VIEW_CASES[case]
    check_op(graph_fn, {"x": (("n", 4, 6), dtype)}, lambda sz: {"x": rand_any((sz["n"], 4, 6), dtype)},
             torch_fn, mode)


SLICES = [(0, 1, None, 1), (1, -3, None, 1), (-1, 0, None, 2), (1, 1, -1, 2), (2, 1, 5, 3), (2, 4, 2, 1),
          (2, -100, 3, 1), (0, 0, 100, 1), (-2, 3, 100, 1)]


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dim,start,end,step", SLICES)
def test_slice(dim, start, end, step, mode):
    def expect(x):
        idx = [slice(None)] * x.ndim
        idx[dim] = slice(start, end, step)
        return x[tuple(idx)]

    sizes = ({"n": 2}, {"n": 7}) if mode == "static" else None  # start=1 on dim 0 needs n >= 2
    check_op(lambda x: F.slice(x, dim=dim, start=start, end=end, step=step), {"x": (("n", 4, 6), torch.float32)},
             lambda sz: {"x": randn(sz["n"], 4, 6)}, expect, mode, sizes)


def test_slice_symbolic_end():
    check_op(lambda x: x[:100], {"x": (("n", 4), torch.float32)}, lambda sz: {"x": randn(sz["n"], 4)},
             lambda x: x[:100], "symbolic")


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=dt_id)
@pytest.mark.parametrize("case", ["full", "-1", "new_leading", "method_varargs"])
def test_expand(case, dtype, mode):
    graph_fn = {"full": lambda x: F.expand(x, (x.shape[0], 4, 5)),
                "-1": lambda x: F.expand(x, (-1, 4, -1)),
                "new_leading": lambda x: F.expand(x, (2, x.shape[0], 4, 5)),
                "method_varargs": lambda x: x.expand(3, x.shape[0], 4, 5)}[case]
    lead = {"full": (), "-1": (), "new_leading": (2,), "method_varargs": (3,)}[case]

    def expect(x):
        out = torch.empty(lead + (x.shape[0], 4, 5), dtype=dtype)
        for j in range(4):           # copy the size-1 dim by hand
            out[..., j, :] = x[:, 0, :]
        return out

    check_op(graph_fn, {"x": (("n", 1, 5), dtype)}, lambda sz: {"x": rand_any((sz["n"], 1, 5), dtype)}, expect, mode)


SPLITS = [(2, -1, 6), (3, -1, 9), ((2, 5, 1), -1, 8), ((1, 1), 1, 2), ((4,), -1, 4), (1, 1, 2)]


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("sections,dim,size", SPLITS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dt_id)
def test_split(sections, dim, size, dtype, mode):
    shape = ("n", size, 3) if dim == 1 else ("n", 3, size)
    d = dim % 3
    parts = [size // sections] * sections if isinstance(sections, int) else list(sections)

    def expect(x):
        outs, at = [], 0
        for p in parts:
            idx = [slice(None)] * 3
            idx[d] = slice(at, at + p)
            outs.append(x[tuple(idx)])
            at += p
        return tuple(outs)

    graph = lambda x: F.split(x, sections, dim)
    check_op(graph, {"x": (shape, dtype)}, lambda sz: {"x": randn(*[_extent(s, sz) for s in shape], dtype=dtype)},
             expect, mode)


@pytest.mark.parametrize("sections", [3, (1, "rest")], ids=str)
def test_split_symbolic_dim(sections):
    """Splitting the symbolic dim itself: into 3 equal parts (n = 3, 33) or by Dim-valued sizes."""
    if sections == 3:
        graph = lambda x: F.split(x, 3, 0)
        expect = lambda x: tuple(x[i * (x.shape[0] // 3):(i + 1) * (x.shape[0] // 3)] for i in range(3))
    else:
        graph = lambda x: F.split(x, (1, x.shape[0] - 1), 0)
        expect = lambda x: (x[:1], x[1:])
    check_op(graph, {"x": (("n", 2), torch.float32)}, lambda sz: {"x": randn(sz["n"], 2)}, expect, "symbolic")


def test_split_symbolic_not_divisible_at_run_time():
    with Network() as net:
        x = Tensor("x", (Dim("n"), 2), torch.float32)
        a, b = F.split(x, 2, 0)
        net.mark_output(a, "a")
    engine = net.build_engine()
    assert torch.equal(engine.forward({"x": torch.arange(8.0).reshape(4, 2)})["a"], torch.arange(4.0).reshape(2, 2))
    with pytest.raises(BindError, match=r"split.*dim 0 of size 5 does not split into 2 equal parts"):
        engine.forward({"x": torch.randn(5, 2)})


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("case", ["dim0", "dim-1_three", "dim1_same", "single"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64], ids=dt_id)
def test_cat(case, dtype, mode):
    shapes, dim = {"dim0": ([("n", 5), (2, 5)], 0), "dim-1_three": ([("n", 1), ("n", 3), ("n", 2)], -1),
                   "dim1_same": ([(2, "n", 3), (2, "n", 3)], 1), "single": ([("n", 4)], 0)}[case]
    names = [f"x{i}" for i in range(len(shapes))]

    def expect(**xs):
        parts = [xs[n] for n in names]
        d = dim % parts[0].ndim
        total = sum(p.shape[d] for p in parts)
        out = torch.empty(parts[0].shape[:d] + (total,) + parts[0].shape[d + 1:], dtype=dtype)
        at = 0
        for p in parts:
            idx = [slice(None)] * p.ndim
            idx[d] = slice(at, at + p.shape[d])
            out[tuple(idx)] = p
            at += p.shape[d]
        return out

    check_op(lambda **xs: F.cat([xs[n] for n in names], dim), {n: (s, dtype) for n, s in zip(names, shapes)},
             lambda sz: {n: rand_any(tuple(_extent(e, sz) for e in s), dtype) for n, s in zip(names, shapes)},
             expect, mode)


GATHERS = [(0, ("k",)), (1, ("k",)), (-1, ("k",)), (-2, ("k",)), (1, (2, 3)), (-1, (2, "k")), (0, ())]


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dim,ishape", GATHERS, ids=str)
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64], ids=dt_id)
def test_gather(dim, ishape, idtype, mode):
    """Seed semantics: take whole slices of x at ``index`` along ``dim`` (index_select for 1-D)."""
    xshape = ("n", 7, 4)
    sizes = ({"n": 2, "k": 1}, {"n": 5, "k": 9}) if mode == "static" else ({"n": 3, "k": 4}, {"n": 33, "k": 1})

    def make(sz):
        x = randn(*[_extent(s, sz) for s in xshape])
        size = x.shape[dim]
        return {"x": x, "i": torch.randint(0, size, tuple(_extent(s, sz) for s in ishape), dtype=idtype)}

    def expect(x, i):
        d = dim % x.ndim
        return x[(slice(None),) * d + (i.long(),)]     # one advanced index lands at position d

    check_op(lambda x, i: F.gather(x, dim, i), {"x": (xshape, torch.float32), "i": (ishape, idtype)},
             make, expect, mode, sizes)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64], ids=dt_id)
def test_index_mask(idtype, mode):
    """mask[t, j] = j in ids[t]: a top-k's chosen set as a dense mask (repeated ids count once)."""
    sizes = ({"n": 1}, {"n": 6}) if mode == "static" else ({"n": 3}, {"n": 17})

    def make(sz):
        return {"i": torch.randint(0, 9, (sz["n"], 3), dtype=idtype)}

    def expect(i):
        return torch.stack([(i == j).any(-1) for j in range(9)], -1)

    check_op(lambda i: F.index_mask(i, 9), {"i": (("n", 3), idtype)}, make, expect, mode, sizes)
    with pytest.raises(GraphDSLError, match="size must be a positive int, got 0"):
        with Network():
            F.index_mask(Tensor("i", (4, 2), torch.int64), 0)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("ishape", [("n",), (2, "n")], ids=str)
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64], ids=dt_id)
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_embedding(ishape, idtype, dtype, mode):
    def make(sz):
        return {"ids": torch.randint(0, 11, tuple(_extent(s, sz) for s in ishape), dtype=idtype),
                "table": randn(11, 6, dtype=dtype)}

    def expect(ids, table):
        out = torch.empty(ids.shape + (6,), dtype=dtype)
        flat = out.reshape(-1, 6)
        for j, t in enumerate(ids.reshape(-1).tolist()):
            flat[j] = table[t]
        return out

    check_op(F.embedding, {"ids": (ishape, idtype), "table": ((11, 6), dtype)}, make, expect, mode)


GETITEMS = {
    "int": lambda x, i: x[1], "neg_int": lambda x, i: x[-1], "neg_int2": lambda x, i: x[-2],
    "slice": lambda x, i: x[1:3], "step": lambda x, i: x[::2], "slice_step": lambda x, i: x[1:-1:2],
    "neg_start": lambda x, i: x[-2:], "col": lambda x, i: x[:, 2], "col_neg": lambda x, i: x[:, -3],
    "ellipsis_last": lambda x, i: x[..., -1], "none": lambda x, i: x[None],
    "none_mid": lambda x, i: x[:, None, 1:4], "ellipsis_none": lambda x, i: x[..., None],
    "int_ellipsis_slice": lambda x, i: x[1, ..., 2:], "ellipsis_only": lambda x, i: x[...],
    "all_ints": lambda x, i: x[0, -1, 2], "tensor": lambda x, i: x[i], "tensor_mid": lambda x, i: x[:, i],
    "tensor_after_ellipsis": lambda x, i: x[..., i], "tensor_then_int": lambda x, i: x[i, 0],
    "none_tensor": lambda x, i: x[None, :, i], "inner_steps": lambda x, i: x[:, 1::2, ::3],
    "F.getitem": lambda x, i: F.getitem(x, (slice(1, None), -2)) if isinstance(x, Tensor) else x[1:, -2],
}


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("case,ishape", [(c, (3,)) for c in GETITEMS]
                         + [(c, (2, 2)) for c in GETITEMS if "tensor" in c], ids=str)
def test_getitem(case, ishape, mode):
    fn = GETITEMS[case]
    sizes = ({"n": 3}, {"n": 7}) if mode == "static" else ({"n": 3}, {"n": 9})

    def make(sz):
        return {"x": randn(sz["n"], 5, 6), "i": torch.randint(0, 3, ishape)}

    check_op(fn, {"x": (("n", 5, 6), torch.float32), "i": (ishape, torch.int64)}, make, fn, mode, sizes)


def test_getitem_rejects_two_tensor_indices():
    """torch pairs several tensor indices elementwise; sequential gathers would silently differ."""
    with Network():
        x = Tensor("x", (4, 5), torch.float32)
        i, j = Tensor("i", (3,), torch.int64), Tensor("j", (3,), torch.int64)
        with pytest.raises(GraphDSLError, match=r"one Tensor index"):
            x[i, j]


@pytest.mark.parametrize("idx,msg", [((Ellipsis, 0, Ellipsis), r"only one Ellipsis"),
                                     ((0, 0, 0, 0), r"too many indices \(4\) for tensor 'x' of rank 3"),
                                     ((True,), r"unsupported index True"),
                                     (("a",), r"unsupported index 'a' \(str\)")], ids=str)
def test_getitem_errors(idx, msg):
    with Network():
        x = Tensor("x", (4, 5, 6), torch.float32)
        with pytest.raises(GraphDSLError, match=msg):
            x[idx]


# ---------------------------------------------------------------------------------------------
# attention: rope, reshape_and_cache, paged_attention
# ---------------------------------------------------------------------------------------------
def _rotate_half(x):
    """HF transformers' rotate_half."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    """GPT-J's rotate_every_two (interleaved pairs)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rope_expected(x, freqs, layout):
    """freqs [T, r/2] (positions × inverse frequencies); apply to the first r dims of each head."""
    r = 2 * freqs.shape[-1]
    rot, rest = x[..., :r].double(), x[..., r:]
    if layout is F.RopeLayout.NEOX:
        emb = torch.cat((freqs, freqs), dim=-1)
        rotated = rot * emb.cos()[:, None] + _rotate_half(rot) * emb.sin()[:, None]
    else:
        emb = freqs.repeat_interleave(2, dim=-1)
        rotated = rot * emb.cos()[:, None] + _rotate_every_two(rot) * emb.sin()[:, None]
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("layout", list(F.RopeLayout), ids=lambda l: l.name)
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_rope(dtype, layout, rotary, mode):
    head_dim = 16
    half = 8 if rotary == "full" else 3       # partial: rotate the first 6 dims, pass 10 through
    store = {}

    def make(sz):
        pos = torch.randint(0, 4096, (sz["n"],)).double()
        inv = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float64) * 2 / (2 * half))
        freqs = pos[:, None] * inv[None, :]
        store[sz["n"]] = freqs
        return {"q": randn(sz["n"], 4, head_dim, dtype=dtype), "k": randn(sz["n"], 2, head_dim, dtype=dtype),
                "cos": freqs.cos().float(), "sin": freqs.sin().float()}

    def expect(q, k, cos, sin):
        freqs = store[q.shape[0]]
        return _rope_expected(q, freqs, layout), _rope_expected(k, freqs, layout)

    decl = {"q": (("n", 4, head_dim), dtype), "k": (("n", 2, head_dim), dtype),
            "cos": (("n", half), torch.float32), "sin": (("n", half), torch.float32)}
    # float32 tables of positions up to 4096: the angle itself carries ~4e-4 absolute error
    check_op(lambda q, k, cos, sin: F.rope(q, k, cos, sin, layout=layout), decl, make, expect, mode,
             scale=1.0 if dtype != torch.float32 else 30.0)


@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_rope_position_zero_is_identity_and_differs_from_other_layout(dtype):
    """cos=1, sin=0 leaves q unchanged; a non-trivial angle makes NEOX and GPTJ differ."""
    q, k = randn(3, 2, 8, dtype=dtype), randn(3, 1, 8, dtype=dtype)
    freqs = torch.tensor([[0.0] * 4, [0.3, 0.7, 1.1, 2.0], [1.0, 0.1, 0.01, 0.001]], dtype=torch.float64)
    outs = {}
    for layout in F.RopeLayout:
        with Network() as net:
            tq, tk = Tensor("q", (3, 2, 8), dtype), Tensor("k", (3, 1, 8), dtype)
            c, s = Tensor("cos", (3, 4), torch.float32), Tensor("sin", (3, 4), torch.float32)
            oq, ok = F.rope(tq, tk, c, s, layout=layout)
            net.mark_output(oq, "q")
            net.mark_output(ok, "k")
        outs[layout] = net.build_engine().forward({"q": q, "k": k, "cos": freqs.cos().float(), "sin": freqs.sin().float()})
        assert torch.equal(outs[layout]["q"][0], q[0]) and torch.equal(outs[layout]["k"][0], k[0])
    assert not torch.allclose(outs[F.RopeLayout.NEOX]["q"][1:].float(), outs[F.RopeLayout.GPTJ]["q"][1:].float())


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
def test_reshape_and_cache(dtype, mode):
    nb, bs, hk, d = 5, 4, 2, 8
    sizes = ({"n": 3}, {"n": 9}) if mode == "static" else ({"n": 6}, {"n": 11})

    def make(sz):
        n = sz["n"]
        slots = torch.randperm(nb * bs)[:n]
        slots[torch.rand(n) < 0.3] = -1           # padding tokens: not written
        slots[0] = -1
        return {"k": randn(n, hk, d, dtype=dtype), "v": randn(n, hk, d, dtype=dtype),
                "kc": randn(nb, bs, hk, d, dtype=dtype), "vc": randn(nb, bs, hk, d, dtype=dtype),
                "slot": slots.to(torch.int32)}

    def expect(k, v, kc, vc, slot):
        kc, vc = kc.clone(), vc.clone()
        for t, s in enumerate(slot.tolist()):
            if s >= 0:
                kc[s // bs, s % bs] = k[t]
                vc[s // bs, s % bs] = v[t]
        return kc, vc

    decl = {"k": (("n", hk, d), dtype), "v": (("n", hk, d), dtype), "kc": ((nb, bs, hk, d), dtype),
            "vc": ((nb, bs, hk, d), dtype), "slot": (("n",), torch.int32)}
    runs = check_op(lambda k, v, kc, vc, slot: F.reshape_and_cache(k, v, kc, vc, slot), decl, make, expect, mode,
                    sizes)
    # the caller's caches are updated in place too
    engine, feeds, _ = runs[-1]
    kc, vc = feeds["kc"].clone(), feeds["vc"].clone()
    engine.forward({**feeds, "kc": kc, "vc": vc})
    want_k, want_v = expect(**feeds)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert not torch.equal(kc, feeds["kc"])


def _dense_attention(q, ks, vs, starts, news, scale, window, cap, alibi=()):
    """Causal softmax attention per sequence from its full K/V ([L, Hk, D], before caching);
    query i of a sequence with L keys and n new tokens sits at position L - n + i. ``alibi``: per
    query head slopes, added as Bloom does (``slope * key position``, not relative to the query)."""
    out = torch.zeros(q.shape[0], q.shape[1], vs[0].shape[-1], dtype=torch.float64)
    hq = q.shape[1]
    for k, v, q0, n in zip(ks, vs, starts, news):
        L, hk = k.shape[0], k.shape[1]
        g = hq // hk
        qs = q[q0:q0 + n].double().reshape(n, hk, g, -1)          # head h -> kv head h // g
        s = torch.einsum("nkgd,lkd->kgnl", qs, k.double()) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        if alibi:
            s = s + torch.tensor(alibi, dtype=torch.float64).reshape(hk, g, 1, 1) * torch.arange(L)
        pq = torch.arange(L - n, L)[:, None]
        pk = torch.arange(L)[None, :]
        allowed = pk <= pq
        if window:
            allowed &= pq - pk < window
        s = s.masked_fill(~allowed, float("-inf"))
        p = math.e ** (s - s.max(-1, keepdim=True).values)
        p = p / p.sum(-1, keepdim=True)
        out[q0:q0 + n] = torch.einsum("kgnl,lkd->nkgd", p, v.double()).reshape(n, hq, -1)
    return out


def _paged_setup(ctx_lens, new_lens, hk, d, dtype, nb=24, bs=4, pad_tokens=1):
    """Random K/V per sequence, a shuffled block table, prefixes pre-written into garbage-filled
    caches, and the packed new tokens (plus padding tokens with slot -1)."""
    kc, vc = randn(nb, bs, hk, d, dtype=dtype, scale=5.0), randn(nb, bs, hk, d, dtype=dtype, scale=5.0)
    need = [(L + bs - 1) // bs for L in ctx_lens]
    perm = torch.randperm(nb).tolist()
    max_blocks = max(need) + 1
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    ks, vs, new_k, new_v, slots = [], [], [], [], []
    at = 0
    for s, (L, n) in enumerate(zip(ctx_lens, new_lens)):
        blocks = perm[at:at + need[s]]
        at += need[s]
        tables[s, :need[s]] = torch.tensor(blocks)
        k, v = randn(L, hk, d, dtype=dtype), randn(L, hk, d, dtype=dtype)
        ks.append(k)
        vs.append(v)
        for p in range(L):
            b, o = blocks[p // bs], p % bs
            if p < L - n:
                kc[b, o], vc[b, o] = k[p], v[p]
            else:
                slots.append(b * bs + o)
        new_k.append(k[L - n:])
        new_v.append(v[L - n:])
    for _ in range(pad_tokens):
        new_k.append(randn(1, hk, d, dtype=dtype))
        new_v.append(randn(1, hk, d, dtype=dtype))
        slots.append(-1)
    return kc, vc, tables, ks, vs, torch.cat(new_k), torch.cat(new_v), torch.tensor(slots, dtype=torch.int32)


ATTN_CONFIGS = {  # ctx lens, new lens, window, soft cap
    "prefill_one": ([7], [7], 0, 0.0),
    "prefill_prefix": ([9, 5, 13], [3, 5, 1], 0, 0.0),
    "window": ([11, 6], [4, 6], 3, 0.0),
    "soft_cap": ([10, 3], [2, 3], 0, 2.0),
    "window_cap": ([17], [5], 6, 1.5),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("cfg", list(ATTN_CONFIGS))
def test_paged_attention_prefill(cfg, group, dtype):
    ctx, new, window, cap = ATTN_CONFIGS[cfg]
    hk, d = 2, 8
    hq = hk * group
    kc, vc, tables, ks, vs, k_new, v_new, slots = _paged_setup(ctx, new, hk, d, dtype)
    t = k_new.shape[0]
    q = randn(t, hq, d, dtype=dtype, scale=2.0)
    starts = [sum(new[:i]) for i in range(len(new))]
    qsl = torch.tensor(starts + [sum(new)], dtype=torch.int32)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    with Network() as net:
        tq = Tensor("q", (t, hq, d), dtype)
        tk, tv = Tensor("k", (t, hk, d), dtype), Tensor("v", (t, hk, d), dtype)
        tkc, tvc = Tensor("kc", tuple(kc.shape), dtype), Tensor("vc", tuple(vc.shape), dtype)
        tslot, tbt = Tensor("slot", (t,), torch.int32), Tensor("bt", tuple(tables.shape), torch.int32)
        tlens, tqsl = Tensor("lens", (len(ctx),), torch.int32), Tensor("qsl", (len(ctx) + 1,), torch.int32)
        kc2, vc2 = F.reshape_and_cache(tk, tv, tkc, tvc, tslot)
        out = F.paged_attention(tq, kc2, vc2, tbt, tlens, tqsl, sliding_window=window or None, soft_cap=cap or None)
        assert (out.shape, out.dtype) == ((t, hq, d), dtype)
        net.mark_output(out, "out")
    got = net.build_engine().forward({"q": q, "k": k_new, "v": v_new, "kc": kc, "vc": vc, "slot": slots,
                                      "bt": tables, "lens": seq_lens, "qsl": qsl})["out"]
    want = _dense_attention(q, ks, vs, starts, new, 1 / math.sqrt(d), window, cap).to(dtype)
    n_real = sum(new)          # the padding token belongs to no sequence
    assert_close(got[:n_real], want[:n_real], 2.0, f"paged_attention {cfg}")


@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window,cap,scale", [(0, 0.0, None), (4, 0.0, None), (0, 3.0, 0.2)], ids=str)
def test_paged_attention_decode_symbolic(group, dtype, window, cap, scale):
    """Decode (no query_start_loc: one query per sequence) with Dims for the batch, two batch sizes
    through one engine; the new token is written by reshape_and_cache in the same graph."""
    hk, d = 2, 8
    hq = hk * group
    S, MB = Dim("num_seqs"), Dim("max_blocks")
    with Network() as net:
        tq = Tensor("q", (S, hq, d), dtype)
        tk, tv = Tensor("k", (S, hk, d), dtype), Tensor("v", (S, hk, d), dtype)
        tkc, tvc = Tensor("kc", (24, 4, hk, d), dtype), Tensor("vc", (24, 4, hk, d), dtype)
        tslot, tbt = Tensor("slot", (S,), torch.int32), Tensor("bt", (S, MB), torch.int32)
        tlens = Tensor("lens", (S,), torch.int32)
        kc2, vc2 = F.reshape_and_cache(tk, tv, tkc, tvc, tslot)
        out = F.paged_attention(tq, kc2, vc2, tbt, tlens, scale=scale, sliding_window=window, soft_cap=cap)
        assert (out.shape, out.dtype) == ((S, hq, d), dtype)
        net.mark_output(out, "out")
    engine = net.build_engine()
    for ctx in ([5, 12, 1], [9]):
        kc, vc, tables, ks, vs, k_new, v_new, slots = _paged_setup(ctx, [1] * len(ctx), hk, d, dtype, pad_tokens=0)
        q = randn(len(ctx), hq, d, dtype=dtype, scale=2.0)
        got = engine.forward({"q": q, "k": k_new, "v": v_new, "kc": kc, "vc": vc, "slot": slots, "bt": tables,
                              "lens": torch.tensor(ctx, dtype=torch.int32)})["out"]
        want = _dense_attention(q, ks, vs, list(range(len(ctx))), [1] * len(ctx),
                                scale if scale is not None else 1 / math.sqrt(d), window, cap).to(dtype)
        assert got.shape == (len(ctx), hq, d)
        assert_close(got, want, 2.0, f"decode ctx={ctx}")


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (3, 0.0), (0, 2.0)], ids=str)
def test_paged_attention_alibi(decode, window, cap):
    """ALiBi slopes per query head (GQA group 2): the op's ``m_h * (k - p)`` bias equals Bloom's
    ``m_h * k`` under softmax, with a window and a soft cap too."""
    hk, d, dtype = 2, 8, torch.float32
    hq = 2 * hk
    slopes = tuple(2.0 ** -(i + 1) for i in range(hq))
    ctx, new = ([11, 6, 9], [1, 1, 1]) if decode else ([11, 6], [4, 6])
    kc, vc, tables, ks, vs, k_new, v_new, slots = _paged_setup(ctx, new, hk, d, dtype, pad_tokens=0)
    t = sum(new)
    q = randn(t, hq, d, dtype=dtype, scale=2.0)
    starts = [sum(new[:i]) for i in range(len(new))]
    qsl = None if decode else torch.tensor(starts + [t], dtype=torch.int32)
    with Network() as net:
        tkc, tvc = Tensor("kc", tuple(kc.shape), dtype), Tensor("vc", tuple(vc.shape), dtype)
        kc2, vc2 = F.reshape_and_cache(Tensor("k", (t, hk, d), dtype), Tensor("v", (t, hk, d), dtype), tkc, tvc,
                                       Tensor("slot", (t,), torch.int32))
        tqsl = None if decode else Tensor("qsl", (len(ctx) + 1,), torch.int32)
        out = F.paged_attention(Tensor("q", (t, hq, d), dtype), kc2, vc2, Tensor("bt", tuple(tables.shape), torch.int32),
                                Tensor("lens", (len(ctx),), torch.int32), tqsl, sliding_window=window, soft_cap=cap,
                                alibi_slopes=list(slopes))
        assert out.producer.attrs["alibi_slopes"] == slopes
        net.mark_output(out, "out")
    feed = {"q": q, "k": k_new, "v": v_new, "kc": kc, "vc": vc, "slot": slots, "bt": tables,
            "lens": torch.tensor(ctx, dtype=torch.int32)} | ({} if decode else {"qsl": qsl})
    got = net.build_engine().forward(feed)["out"]
    want = _dense_attention(q, ks, vs, starts, new, 1 / math.sqrt(d), window, cap, slopes).to(dtype)
    assert_close(got, want, 2.0, "paged_attention alibi")
    plain = _dense_attention(q, ks, vs, starts, new, 1 / math.sqrt(d), window, cap).to(dtype)
    assert (got - plain).abs().max() > 1e-2          # the bias matters in this case
    with Network(), pytest.raises(GraphDSLError, match="alibi_slopes has 3 slopes for 4 query heads"):
        F.paged_attention(Tensor("q", (1, hq, d), dtype), Tensor("kc", tuple(kc.shape), dtype),
                          Tensor("vc", tuple(kc.shape), dtype), Tensor("bt", (1, 3), torch.int32),
                          Tensor("lens", (1,), torch.int32), alibi_slopes=[1.0, 2.0, 3.0])


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_paged_mla_attention(decode):
    """Latent attention: the cache rows' two halves form one latent per position shared by every
    head; equals dense causal attention with keys = latent and values = its first value_dim dims."""
    half, h, lora = 6, 3, 8
    ctx, new = ([7, 3, 5], [1, 1, 1]) if decode else ([7, 3], [4, 3])
    kc, vc, tables, ks, vs, k_new, v_new, slots = _paged_setup(ctx, new, 1, half, torch.float32, pad_tokens=0)
    t = sum(new)
    q = randn(t, h, 2 * half, dtype=torch.float32, scale=2.0)
    starts = [sum(new[:i]) for i in range(len(new))]
    with Network() as net:
        tkc, tvc = Tensor("kc", tuple(kc.shape), torch.float32), Tensor("vc", tuple(vc.shape), torch.float32)
        kc2, vc2 = F.reshape_and_cache(Tensor("k", (t, 1, half), torch.float32),
                                       Tensor("v", (t, 1, half), torch.float32), tkc, tvc,
                                       Tensor("slot", (t,), torch.int32))
        tqsl = None if decode else Tensor("qsl", (len(ctx) + 1,), torch.int32)
        out = F.paged_mla_attention(Tensor("q", (t, h, 2 * half), torch.float32), kc2, vc2,
                                    Tensor("bt", tuple(tables.shape), torch.int32),
                                    Tensor("lens", (len(ctx),), torch.int32), tqsl, scale=0.3, value_dim=lora)
        assert (out.shape, out.dtype) == ((t, h, lora), torch.float32)
        net.mark_output(out, "out")
    feed = {"q": q, "k": k_new, "v": v_new, "kc": kc, "vc": vc, "slot": slots, "bt": tables,
            "lens": torch.tensor(ctx, dtype=torch.int32)}
    if not decode:
        feed["qsl"] = torch.tensor(starts + [t], dtype=torch.int32)
    got = net.build_engine().forward(feed)["out"]
    latents = [torch.cat((k, v), -1) for k, v in zip(ks, vs)]                 # [L, 1, 2 * half]
    want = _dense_attention(q, latents, [c[..., :lora] for c in latents], starts, new, 0.3, 0, 0.0)
    assert_close(got, want.float(), 2.0, "paged_mla_attention")
    with Network(), pytest.raises(GraphDSLError, match="q's latent_dim 10 must be twice the caches' 6"):
        F.paged_mla_attention(Tensor("q", (1, h, 10), torch.float32), Tensor("kc", tuple(kc.shape), torch.float32),
                              Tensor("vc", tuple(kc.shape), torch.float32), Tensor("bt", (1, 3), torch.int32),
                              Tensor("lens", (1,), torch.int32), scale=1.0, value_dim=8)


def test_paged_attention_prefill_symbolic_tokens_and_seqs():
    """Prefill with Dims for tokens, sequences (query_start_loc is num_seqs + 1) and table width."""
    hk, d, group, dtype = 1, 8, 4, torch.float32
    T, S, MB = Dim("num_tokens"), Dim("num_seqs"), Dim("max_blocks")
    with Network() as net:
        tq = Tensor("q", (T, hk * group, d), dtype)
        tkc, tvc = Tensor("kc", (24, 4, hk, d), dtype), Tensor("vc", (24, 4, hk, d), dtype)
        tk, tv, tslot = Tensor("k", (T, hk, d), dtype), Tensor("v", (T, hk, d), dtype), Tensor("slot", (T,), torch.int32)
        tbt, tlens, tqsl = Tensor("bt", (S, MB), torch.int32), Tensor("lens", (S,), torch.int32), \
            Tensor("qsl", (S + 1,), torch.int32)
        kc2, vc2 = F.reshape_and_cache(tk, tv, tkc, tvc, tslot)
        net.mark_output(F.paged_attention(tq, kc2, vc2, tbt, tlens, tqsl), "out")
    engine = net.build_engine()
    for ctx, new in (([6, 10], [6, 2]), ([3, 8, 20], [1, 8, 7])):
        kc, vc, tables, ks, vs, k_new, v_new, slots = _paged_setup(ctx, new, hk, d, dtype)
        q = randn(k_new.shape[0], hk * group, d)
        starts = [sum(new[:i]) for i in range(len(new))]
        got = engine.forward({"q": q, "k": k_new, "v": v_new, "kc": kc, "vc": vc, "slot": slots, "bt": tables,
                              "lens": torch.tensor(ctx, dtype=torch.int32),
                              "qsl": torch.tensor(starts + [sum(new)], dtype=torch.int32)})["out"]
        want = _dense_attention(q, ks, vs, starts, new, 1 / math.sqrt(d), 0, 0.0).float()
        assert_close(got[:sum(new)], want[:sum(new)], 1.0, f"prefill ctx={ctx}")


# ---------------------------------------------------------------------------------------------
# quantized linear (schemes: tests/core/test_quant.py; kernels: tests/kernels/test_quant_linear.py)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int4-g32-zp", "int8-channel", "fp8-tensor"])
def test_quant_linear_symbolic_rows(scheme):
    from graphdsl.quant import parse_scheme
    s = parse_scheme(scheme)
    stored = s.quantize(torch.randn(24, 64), torch.float32)
    with Network() as net:
        ins = [Tensor(f"w{i}", tuple(t.shape), t.dtype) for i, t in enumerate(stored)]
        y = F.quant_linear(Tensor("x", (Dim("n"), 64), torch.float32), *ins, scheme=scheme, out_features=24,
                           in_features=64)
        assert y.shape[1] == 24 and y.dtype == torch.float32
        net.mark_output(y, "y")
    engine = net.build_engine()
    for n in (1, 5):
        x = torch.randn(n, 64)
        got = engine.forward({"x": x, **{f"w{i}": t for i, t in enumerate(stored)}})["y"]
        assert_close(got, x @ s.dequantize(stored, 24, 64, torch.float32).T, 1.0, f"{scheme} n={n}")
    with pytest.raises(ShapeError, match=r"stored tensor '_packed' should be \[24, 32\]"):
        F.quant_linear(Tensor("x", (2, 64), torch.float32), Tensor("p", (24, 64), torch.uint8),
                       Tensor("s", (24, 2), torch.float32), Tensor("z", (24, 2), torch.float32),
                       scheme="int4-g32-zp", out_features=24, in_features=64)


@pytest.mark.parametrize("schemes", [("int4-g32-zp", "int8-channel"), ("fp8-channel", "int4-g32")])
def test_quant_moe_experts_symbolic_tokens(schemes):
    """``quant_moe_experts`` over symbolic tokens against a per-token loop over each token's chosen
    experts on the dequantized stacks; a stored tensor of the wrong shape is named."""
    from graphdsl.quant import parse_scheme
    E, H, I = 4, 64, 32
    up_s, down_s = (parse_scheme(n) for n in schemes)
    g = torch.Generator().manual_seed(4)
    up = up_s.quantize_stack(torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.float32)
    down = down_s.quantize_stack(torch.randn(E, H, I, generator=g) * 0.3, torch.float32)
    stored = up + down
    with Network() as net:
        ins = [Tensor(f"w{i}", tuple(t.shape), t.dtype) for i, t in enumerate(stored)]
        n = Dim("n")
        y = F.quant_moe_experts(Tensor("x", (n, H), torch.float32), Tensor("routing", (n, E), torch.float32), *ins,
                                gate_up_scheme=schemes[0], down_scheme=schemes[1], experts=E, hidden=H,
                                intermediate=I, top_k=2)
        net.mark_output(y, "y")
    engine = net.build_engine()
    w_up = up_s.dequantize_stack(up, 2 * I, H, torch.float32)
    w_down = down_s.dequantize_stack(down, H, I, torch.float32)
    for t in (1, 5):
        x, scores = torch.randn(t, H, generator=g), torch.rand(t, E, generator=g)
        top = scores.topk(2, dim=-1).indices
        routing = torch.zeros_like(scores).scatter(1, top, scores.gather(1, top))
        got = engine.forward({"x": x, "routing": routing, **{f"w{i}": w for i, w in enumerate(stored)}})["y"]
        want = torch.zeros_like(x)
        for r in range(t):
            for e in routing[r].nonzero().flatten().tolist():
                a, b = (w_up[e] @ x[r]).chunk(2)
                want[r] += routing[r, e] * (w_down[e] @ (torch.nn.functional.silu(a) * b))
        assert_close(got, want, 10.0, f"{schemes} tokens={t}")
    bad = [Tensor(f"b{i}", tuple(t.shape), t.dtype) for i, t in enumerate(stored)]
    bad[-2] = Tensor("short", (E, H, I // 4), torch.uint8)
    with pytest.raises(ShapeError, match=r"quant_moe_experts: down stored tensor '_packed' should be "
                                         r"\[4, 64, (32|16)\] torch\.u?int8, got \[4, 64, 8\] torch\.uint8"):
        F.quant_moe_experts(Tensor("x", (2, H), torch.float32), Tensor("routing", (2, E), torch.float32), *bad,
                            gate_up_scheme=schemes[0], down_scheme=schemes[1], experts=E, hidden=H, intermediate=I)
    x2, r2 = Tensor("x", (2, H), torch.float32), Tensor("routing", (2, E), torch.float32)
    kw = dict(gate_up_scheme=schemes[0], down_scheme=schemes[1], experts=E, hidden=H, intermediate=I)
    with pytest.raises(ShapeError, match=rf"schemes {schemes[0]} and {schemes[1]} store \d+ \+ \d+ tensors, got "
                                         rf"{len(stored) - 1}"):
        F.quant_moe_experts(x2, r2, *ins[:-1], **kw)
    with pytest.raises(ShapeError, match=r"experts differ: 4 vs 5"):
        F.quant_moe_experts(x2, r2, *ins, **dict(kw, experts=5))
    with pytest.raises(ShapeError, match=r"top_k must be None or an int in \[1, 4\], got 7"):
        F.quant_moe_experts(x2, r2, *ins, **kw, top_k=7)
    with pytest.raises(ShapeError, match=r"act must be a gated ActType"):
        F.quant_moe_experts(x2, r2, *ins, **kw, act=F.ActType.SILU)


# ---------------------------------------------------------------------------------------------
# collectives (world size 1 on CPU; larger worlds need torchrun)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("dtype", FLOATS, ids=dt_id)
@pytest.mark.parametrize("op", ["all_reduce", "all_gather_0", "all_gather_-1", "reduce_scatter"])
def test_collectives_world_size_1(op, dtype, mode):
    graph = {"all_reduce": lambda x: F.all_reduce(x), "all_gather_0": lambda x: F.all_gather(x, dim=0),
             "all_gather_-1": lambda x: F.all_gather(x, dim=-1, world_size=1),
             "reduce_scatter": lambda x: F.reduce_scatter(x, dim=-1, world_size=1)}[op]
    check_op(graph, {"x": (("n", 3), dtype)}, lambda sz: {"x": randn(sz["n"], 3, dtype=dtype)},
             lambda x: x.clone(), mode)


def test_collectives_world_size_2_shapes_and_uninitialised_error():
    with Network() as net:
        x = Tensor("x", (Dim("n"), 3), torch.float32)
        g = F.all_gather(x, dim=-1, world_size=2)
        r = F.all_reduce(x, world_size=2)
        s = F.reduce_scatter(F.all_gather(x, dim=-1, world_size=2), dim=-1, world_size=3)
        assert g.shape == (x.shape[0], 6) and r.shape == x.shape and s.shape == (x.shape[0], 2)
        with pytest.raises(GraphDSLError, match=r"reduce_scatter: dim 0 is the symbolic"):
            F.reduce_scatter(x, dim=0, world_size=2)
        with pytest.raises(GraphDSLError, match=r"dim -1 has size 3, not a multiple of world_size=2"):
            F.reduce_scatter(x, dim=-1, world_size=2)
        net.mark_output(g, "g")
    with pytest.raises(GraphDSLError, match=r"all_gather with world_size > 1 needs torch.distributed initialised"):
        net.build_engine().forward({"x": torch.randn(2, 3)})


# ---------------------------------------------------------------------------------------------
# shape-rule error messages
# ---------------------------------------------------------------------------------------------
def _decl(*specs):
    return [Tensor(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(specs)]


f32, i64 = torch.float32, torch.int64
SHAPE_ERRORS = {
    "matmul_inner": (lambda a, b: a @ b, [((2, 3), f32), ((4, 5), f32)],
                     r"matmul: inner dims differ: \[2, 3\] @ \[4, 5\] \(3 vs 4\)"),
    "matmul_inner_transposed": (lambda a, b: F.matmul(a, b, transpose_b=True), [((2, 3), f32), ((3, 5), f32)],
                                r"matmul: inner dims differ: \[2, 3\] @ \[3, 5\]ᵀ \(3 vs 5\)"),
    "matmul_dtype": (lambda a, b: a @ b, [((2, 3), f32), ((3, 5), torch.float16)],
                     r"matmul: operands must share a dtype, got torch.float32 and torch.float16"),
    "matmul_rank": (lambda a, b: a @ b, [((3,), f32), ((3, 5), f32)], r"matmul: operands need rank >= 2, got \[3\] and \[3, 5\]"),
    "bmm_rank": (lambda a, b: F.bmm(a, b), [((2, 3), f32), ((1, 3, 5), f32)], r"bmm: a must be rank 3, got \[2, 3\]"),
    "split_not_divisible": (lambda x: F.split(x, 2), [((3, 7), f32)],
                            r"split: dim -1 of size 7 does not split into 2 equal parts"),
    "split_sizes": (lambda x: F.split(x, (2, 4), 0), [((7, 2), f32)], r"split: sizes \[2, 4\] sum to 6, dim 0 is 7"),
    "embedding_float_ids": (lambda i, t: F.embedding(i, t), [((4,), f32), ((10, 3), f32)],
                            r"embedding: ids must be int32/int64, got torch.float32"),
    "embedding_table_rank": (lambda i, t: F.embedding(i, t), [((4,), i64), ((10,), f32)],
                             r"embedding: table must be 2-D \[vocab, hidden\], got \[10\]"),
    "broadcast": (lambda a, b: a + b, [((2, 3), f32), ((4,), f32)],
                  r"add: shapes \[2, 3\] and \[4\] do not broadcast \(axis 1: 3 vs 4\)"),
    "reshape_count": (lambda x: x.reshape(4, 4), [((3, 5), f32)],
                      r"reshape: cannot view \[3, 5\] \(15 elements\) as \[4, 4\] \(16 elements\)"),
    "reshape_two_holes": (lambda x: x.reshape(-1, -1), [((3, 5), f32)], r"reshape: at most one -1 allowed"),
    "cat_dtype": (lambda a, b: F.cat([a, b]), [((2, 3), f32), ((2, 3), i64)],
                  r"cat: dtypes differ: torch.float32 vs torch.int64"),
    "cat_shape": (lambda a, b: F.cat([a, b], 0), [((2, 3), f32), ((2, 4), f32)],
                  r"cat: shapes \[2, 3\] and \[2, 4\] differ outside dim 0"),
    "topk_k": (lambda x: F.topk(x, k=8), [((2, 7), f32)], r"topk: k=8 exceeds the size 7 of dim -1"),
    "gather_float_index": (lambda x, i: F.gather(x, 0, i), [((4, 2), f32), ((3,), f32)],
                           r"gather: index must be int32/int64, got torch.float32"),
    "softmax_int": (lambda x: F.softmax(x), [((4,), i64)], r"softmax: needs a floating dtype, got torch.int64"),
    "dim_range": (lambda x: F.sum(x, dim=2), [((4, 3), f32)], r"sum: dim 2 is out of range for a tensor of rank 2"),
    "squeeze_not_1": (lambda x: x.squeeze(0), [((4, 3), f32)], r"squeeze: dim 0 has size 4, not 1"),
    "expand_bad": (lambda x: x.expand(3, 5), [((3, 2), f32)], r"expand: cannot expand \[3, 2\] to \[3, 5\]"),
    "permute_bad": (lambda x: x.permute(0, 0), [((3, 2), f32)], r"permute: dims \[0, 0\] are not a permutation"),
    "norm_weight_rank": (lambda x, w: F.rms_norm(x, w), [((3, 4), f32), ((4, 1), f32)],
                         r"rms_norm: weight must be 1-D, got shape \[4, 1\]"),
    "norm_weight_size": (lambda x, w: F.layer_norm(x, w), [((3, 4), f32), ((5,), f32)],
                         r"layer_norm: shapes \[4\] and \[5\] do not broadcast"),
    "rope_rotary_dim": (lambda q, k, c, s: F.rope(q, k, c, s), [((3, 2, 8), f32), ((3, 1, 8), f32), ((3, 5), f32),
                                                               ((3, 5), f32)],
                        r"rope: rotary dim 10 exceeds q's head_dim 8"),
    "attention_heads": (lambda q, kc, vc, bt, sl: F.paged_attention(q, kc, vc, bt, sl),
                        [((2, 6, 8), f32), ((4, 4, 4, 8), f32), ((4, 4, 4, 8), f32), ((2, 3), torch.int32),
                         ((2,), torch.int32)],
                        r"paged_attention: num_heads 6 is not a multiple of num_kv_heads 4"),
    "lora_rank": (lambda y, x, a, b, i: F.lora_apply(y, x, a, b, i),
                  [((3, 7), f32), ((3, 9), f32), ((2, 4, 9), f32), ((7, 2, 5), f32), ((3,), torch.int32)],
                  r"lora_apply: rank of a and b differ: 4 vs 5"),
    "cache_slots": (lambda k, v, kc, vc, s: F.reshape_and_cache(k, v, kc, vc, s),
                    [((3, 2, 8), f32), ((3, 2, 8), f32), ((4, 4, 2, 8), f32), ((4, 4, 2, 8), f32),
                     ((2,), torch.int32)],
                    r"reshape_and_cache: slot_mapping has 2 entries for 3 tokens"),
}


@pytest.mark.parametrize("case", list(SHAPE_ERRORS))
def test_shape_rule_errors(case):
    fn, specs, msg = SHAPE_ERRORS[case]
    with Network():
        ins = _decl(*specs)
        with pytest.raises(ShapeError, match=msg) as info:
            fn(*ins)
    # record-time errors point at the user's line (this file), not inside graphdsl
    assert re.search(r"test_functional_ops\.py:\d+", str(info.value)), str(info.value)


def test_every_functional_op_is_tested_here():
    """Each public name of graphdsl.functional is called in this file (guards new ops)."""
    src = Path(__file__).read_text()
    missing = [n for n in F.__all__ if not re.search(rf"\bF\.{n}\b", src)]
    assert not missing, f"ops without a differential test: {missing}"
