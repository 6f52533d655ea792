"""Symbolic dims: arithmetic, evaluation, binding across inputs, and binding errors."""
import pytest

from graphdsl import BindError, Dim, GraphDSLError
from graphdsl.dim import DimExpr, bind_shapes, evaluate, same_extent


def test_arithmetic_folds_constants_and_prints():
    n = Dim("n")
    assert n + 0 is n and n * 1 is n and (n * 0) == 0
    e = (n + 1) * 2
    assert str(e) == "(n + 1)*2"
    assert e.evaluate({"n": 5}) == 12
    assert (n // 4).evaluate({"n": 9}) == 2 and (10 - n).evaluate({"n": 3}) == 7


def test_same_name_is_same_dim():
    assert Dim("n") == Dim("n") and hash(Dim("n")) == hash(Dim("n"))
    assert Dim("n") != Dim("m")
    assert same_extent(Dim("n"), Dim("n")) is True
    assert same_extent(Dim("n"), Dim("m")) is None
    assert same_extent(3, 4) is False


def test_max_propagates_through_expressions():
    n, m = Dim("n", max=8), Dim("m", max=3)
    assert (n * m).max == 24 and (n + 2).max == 10 and Dim("k").max is None


def test_bad_dim_arguments():
    with pytest.raises(GraphDSLError, match="identifier"):
        Dim("not a name")
    with pytest.raises(GraphDSLError, match="max must be a positive int"):
        Dim("n", max=0)
    with pytest.raises(GraphDSLError, match="ints or Dims"):
        Dim("n") + 1.5


def test_symbolic_dim_is_not_a_python_int():
    with pytest.raises(GraphDSLError, match="symbolic"):
        range(Dim("n"))


def test_bind_consistent_and_expressions():
    n = Dim("n")
    b = bind_shapes({"x": (n, 4), "y": (n * 2,)}, {"x": (3, 4), "y": (6,)})
    assert b == {"n": 3}
    assert evaluate(n * 2, b) == 6


def test_bind_same_dim_two_values_names_both_inputs():
    n = Dim("n")
    with pytest.raises(BindError, match=r"'n' is 3 in 'x' dim 0 but 5 in 'y' dim 1"):
        bind_shapes({"x": (n, 4), "y": (2, n)}, {"x": (3, 4), "y": (2, 5)})


def test_bind_errors_name_tensor_expected_actual():
    n = Dim("n", max=4)
    with pytest.raises(BindError, match=r"input 'x': expected rank 2 .* got rank 1"):
        bind_shapes({"x": (n, 4)}, {"x": (3,)})
    with pytest.raises(BindError, match=r"input 'x': expected shape \[n, 4\], got \[3, 5\] \(dim 1: expected 4, got 5\)"):
        bind_shapes({"x": (n, 4)}, {"x": (3, 5)})
    with pytest.raises(BindError, match="above its max 4"):
        bind_shapes({"x": (n, 4)}, {"x": (9, 4)})
    with pytest.raises(BindError, match=r"'n\*2' = 6"):
        bind_shapes({"x": (n, 4), "y": (n * 2,)}, {"x": (3, 4), "y": (7,)})


def test_json_round_trip():
    e = (Dim("n", max=8) + 1) * Dim("m")
    assert DimExpr.from_json(e.to_json()) == e


def test_scaled_dims_fold_constant_factors():
    """(n * c) * b, (n * c) // b fold when the constants divide: the rows of a reshape chain such
    as [n, 32, 4] -> [n * 128 // 32, ...] stay `n`, so rewrites that rebuild shapes from another
    operand agree with the recorded ones."""
    n = Dim("n", max=64)
    assert str(n * 32 // 32 * 4 * 8 // 32) == "n"
    assert str(n * 2 * 3) == "n*6" and str(n * 4 // 8) == "n//2"
    assert str(n * 6 // 4) == "n*6//4"                      # not divisible either way: kept
    for v in (1, 7, 64):
        assert (n * 4 // 8).evaluate({"n": v}) == v * 4 // 8
