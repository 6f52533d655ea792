"""Pattern rewriter, in torch.fx's test shape: input program, pattern, expected program, lint(),
numeric equality (engine of the rewritten graph vs engine of the original)."""
from __future__ import annotations

import pytest
import torch

from graphdsl import Network, Tensor
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError
from graphdsl.passes import Rule, Var, apply_rules, ops, replace_pattern
from graphdsl.passes.fused_ops import add_rms_norm


def clone(net: Network) -> Network:
    return Network.from_json(net.to_json())


def ops_of(net: Network) -> list[str]:
    return [n.op for n in net.nodes]


def run(net: Network, feed: dict) -> dict:
    return net.build_engine(backend="torch", passes=[]).forward({k: v.clone() for k, v in feed.items()})


def assert_same_numbers(before: Network, after: Network, feed: dict, tol: float = 1e-6):
    a, b = run(before, feed), run(after, feed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=tol, atol=tol)


def test_replace_pattern_swaps_subgraph_and_keeps_numbers():
    # input program
    with Network("prog") as net:
        x, y = Tensor("x", (4, 8), torch.float32), Tensor("y", (4, 8), torch.float32)
        a = F.exp(x) * y
        net.mark_output(F.exp(a) * x, "out")

    # pattern / replacement: exp(u) * v -> v * exp(u) written as div by exp(-u)
    def pattern(u, v):
        return F.exp(u) * v

    def replacement(u, v):
        return v / F.exp(-u)

    # expected program
    with Network("expected") as want:
        x, y = Tensor("x", (4, 8), torch.float32), Tensor("y", (4, 8), torch.float32)
        a = y / F.exp(-x)
        want.mark_output(x / F.exp(-a), "out")

    work = clone(net)
    res = replace_pattern(work, pattern, replacement)
    work.lint()
    assert res.counts() == {"pattern": 2}
    assert ops_of(work) == ops_of(want) == ["neg", "exp", "div", "neg", "exp", "div"]
    feed = {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}
    assert_same_numbers(net, work, feed, tol=1e-5)
    assert_same_numbers(want, work, feed, tol=1e-5)


def test_var_binds_attribute_and_replacement_receives_it():
    with Network("p") as net:
        x, r = Tensor("x", (3, 16), torch.float32), Tensor("r", (3, 16), torch.float32)
        w = Tensor("w", (16,), torch.float32)
        s = x + r
        net.mark_output(F.rms_norm(s, w, eps=1e-3), "h")
        net.mark_output(s * 2.0, "s2")

    def pattern(x, residual, weight):
        s = x + residual
        return F.rms_norm(s, weight, eps=Var("eps")), s

    seen = {}

    def replacement(x, residual, weight, *, eps):
        seen["eps"] = eps
        return add_rms_norm(x, residual, weight, eps=eps)

    work = clone(net)
    replace_pattern(work, pattern, replacement)
    work.lint()
    assert seen == {"eps": 1e-3}
    assert ops_of(work) == ["add_rms_norm", "scalar", "mul"]
    assert_same_numbers(net, work, {"x": torch.randn(3, 16), "r": torch.randn(3, 16), "w": torch.randn(16)})


def test_exact_attribute_must_match():
    with Network("p") as net:
        x = Tensor("x", (2, 4), torch.float32)
        net.mark_output(F.softmax(x, -1), "y")
    res = replace_pattern(clone(net), lambda x: ops.softmax(x, dim=0), lambda x: x)
    assert res.counts() == {}
    assert "pattern wants dim=0" in res.near_misses[0].reason


def test_intermediate_with_outside_user_blocks_the_match():
    with Network("p") as net:
        x = Tensor("x", (2, 4), torch.float32)
        e = F.exp(x)
        net.mark_output(F.sigmoid(e), "a")
        net.mark_output(e + x, "b")            # the intermediate exp is read outside the pattern

    def pattern(x):
        return F.sigmoid(F.exp(x))

    work = clone(net)
    res = replace_pattern(work, pattern, lambda x: F.tanh(x))
    assert res.counts() == {}
    assert ops_of(work) == ops_of(net)
    (miss,) = res.near_misses
    assert miss.reason.startswith("extra user") and "add" in miss.reason
    assert miss.source.endswith("test_passes_rewriter.py:" + str(_line_of("net.mark_output(F.sigmoid(e)")))


def _line_of(snippet: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if snippet in line and "_line_of" not in line:
                return i
    raise AssertionError(snippet)


def test_extra_check_reason_is_reported_and_false_rejects():
    with Network("p") as net:
        x = Tensor("x", (2, 4), torch.float32)
        net.mark_output(F.exp(x), "y")
    res = replace_pattern(clone(net), lambda x: F.exp(x), lambda x: x, extra_check=lambda m: "dtype: not today")
    assert res.near_misses[0].reason == "dtype: not today"
    res = replace_pattern(clone(net), lambda x: F.exp(x), lambda x: x, extra_check=lambda m: False)
    assert res.near_misses[0].reason == "extra_check rejected the match"


def test_same_parameter_must_bind_same_tensor():
    with Network("p") as net:
        x, y = Tensor("x", (4,), torch.float32), Tensor("y", (4,), torch.float32)
        net.mark_output(x * x, "sq")
        net.mark_output(x * y, "xy")
    work = clone(net)
    res = replace_pattern(work, lambda a: a * a, lambda a: ops.pow(a, F.scalar(a, value=2)))
    work.lint()
    assert res.counts() == {"<lambda>": 1}
    assert ops_of(work) == ["scalar", "pow", "mul"]
    assert_same_numbers(net, work, {"x": torch.randn(4), "y": torch.randn(4)})


def test_rules_reach_a_fixed_point_through_new_matches():
    # removing the inner neg(neg(.)) creates the next match; then sigmoid(exp-free input) fires
    with Network("p") as net:
        x = Tensor("x", (5,), torch.float32)
        net.mark_output(F.sigmoid(F.neg(F.neg(F.neg(F.neg(x))))), "y")
    rules = [Rule("double_neg", lambda x: F.neg(F.neg(x)), lambda x: x),
             Rule("sigmoid_of_input", lambda x: F.sigmoid(x), lambda x: 1.0 / (1.0 + F.exp(F.neg(x))),
                  extra_check=lambda m: True if m.inputs["x"].producer is None else "not a graph input")]
    work = clone(net)
    res = apply_rules(work, rules)
    work.lint()
    assert res.counts() == {"double_neg": 2, "sigmoid_of_input": 1}
    assert ops_of(work) == ["neg", "exp", "scalar", "add", "scalar", "div"]
    assert_same_numbers(net, work, {"x": torch.randn(5)})


def test_rule_that_never_stops_is_an_error():
    with Network("p") as net:
        x = Tensor("x", (5,), torch.float32)
        net.mark_output(F.relu(x), "y")
    with pytest.raises(GraphDSLError, match="fixed point"):
        apply_rules(clone(net), [Rule("grow", lambda x: F.relu(x), lambda x: F.relu(F.neg(F.neg(x))))])


def test_replacement_must_keep_shapes():
    with Network("p") as net:
        x = Tensor("x", (2, 4), torch.float32)
        net.mark_output(F.exp(x), "y")
    with pytest.raises(GraphDSLError, match="keep shapes and dtypes"):
        replace_pattern(clone(net), lambda x: F.exp(x), lambda x: F.sum(x, -1))


def test_pattern_must_be_one_tree():
    with Network("p") as net:
        x = Tensor("x", (2,), torch.float32)
        net.mark_output(F.exp(x), "y")

    def two_roots(a):
        return F.exp(a), F.neg(a)

    with pytest.raises(GraphDSLError, match="one tree rooted"):
        replace_pattern(clone(net), two_roots, lambda a: (a, a))


def test_output_of_the_network_may_be_replaced_by_an_input():
    with Network("p") as net:
        x = Tensor("x", (3,), torch.float32)
        net.mark_output(F.cast(x, torch.float32), "y")
    work = clone(net)
    replace_pattern(work, lambda x: ops.cast(x, dtype=torch.float32), lambda x: x)
    work.lint()
    assert work.nodes == [] and work.outputs["y"] is work.inputs["x"]
    assert_same_numbers(net, work, {"x": torch.randn(3)})
