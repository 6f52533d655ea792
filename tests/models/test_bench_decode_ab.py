"""benchmarks/decode_ab.py: a variant's passes, environment and module patches (a literal or
``@module:attr``) hold while its model is built and captured, and are undone afterwards, also when
the build fails."""
import argparse
import importlib.util
import os
import pathlib
import sys

import pytest


@pytest.fixture(scope="module")
def ab():
    root = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("graphdsl_bench_decode_ab_test", root / "decode_ab.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(root))
    return mod


class _Model:
    def __init__(self, seen):
        self.seen = seen

    def execute(self, phase, inputs, float_logits):
        from graphdsl.runtime.kernels import sampling
        self.seen.append((os.environ.get("GRAPHDSL_DISABLE_PASSES"), os.environ.get("AB_TEST_SETTING"),
                          sampling._SLICE_BLOCKS, sampling.argmax))


class _LLM:
    def __init__(self, seen):
        self.model = _Model(seen)


def test_a_variant_holds_while_built_and_is_undone(ab, monkeypatch):
    from graphdsl.runtime.kernels import sampling
    seen = []
    monkeypatch.setattr(ab, "batch_decode", lambda gd, shape, ctx, quant, batch: (_LLM(seen), {}))
    monkeypatch.delenv("AB_TEST_SETTING", raising=False)
    args = argparse.Namespace(shape="llama-3.2-1b", context=8, quantization=None, batch=1)
    old_blocks, old_argmax = sampling._SLICE_BLOCKS, sampling.argmax
    variant = ("matmul_norm;AB_TEST_SETTING=1;graphdsl.runtime.kernels.sampling:_SLICE_BLOCKS=4"
               ";graphdsl.runtime.kernels.sampling:argmax=@graphdsl.runtime.kernels.sampling:gumbel_argmax")
    ab._build(None, variant, args)
    assert seen == [("matmul_norm", "1", 4, sampling.gumbel_argmax)]
    assert (sampling._SLICE_BLOCKS, sampling.argmax) == (old_blocks, old_argmax)
    assert "AB_TEST_SETTING" not in os.environ and "GRAPHDSL_DISABLE_PASSES" not in os.environ


def test_a_failed_build_undoes_its_variant_too(ab, monkeypatch):
    from graphdsl.runtime.kernels import sampling

    def fail(*a):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(ab, "batch_decode", fail)
    args = argparse.Namespace(shape="llama-3.2-1b", context=8, quantization=None, batch=1)
    old = sampling._SLICE_BLOCKS
    with pytest.raises(RuntimeError, match="out of memory"):
        ab._build(None, ";graphdsl.runtime.kernels.sampling:_SLICE_BLOCKS=4", args)
    assert sampling._SLICE_BLOCKS == old and "GRAPHDSL_DISABLE_PASSES" not in os.environ
