"""A 2-layer transformer decoder written with functional ops equals the same math in plain torch."""
import pytest
import torch

from tests.helpers import tiny_block


@pytest.fixture(scope="module")
def engine():
    eng = tiny_block.build(num_layers=2).build_engine()
    eng.set_weights(tiny_block.weights(2))
    return eng


@pytest.mark.parametrize("num_tokens", [1, 7, 16, 37])
def test_engine_equals_plain_torch(engine, num_tokens):
    feed = tiny_block.inputs(num_tokens, seed=num_tokens)
    want = tiny_block.torch_reference(tiny_block.weights(2), feed)
    got = engine.forward(feed)["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cache_holds_the_keys_after_prefill(engine):
    feed = tiny_block.inputs(9)
    engine.forward(feed)
    k = feed["k_cache0"].view(-1, tiny_block.KV_HEADS, tiny_block.HEAD_DIM)
    assert k[:9].abs().sum() > 0 and k[9:].abs().sum() == 0


def test_half_precision_close_to_float32():
    eng = tiny_block.build(num_layers=2, dtype=torch.bfloat16).build_engine()
    eng.set_weights(tiny_block.weights(2, dtype=torch.bfloat16))
    feed = tiny_block.inputs(6, dtype=torch.bfloat16)
    got = eng.forward(feed)["logits"].float()
    want = tiny_block.torch_reference(tiny_block.weights(2), tiny_block.inputs(6))
    assert (got - want).norm() / want.norm() < 3e-2
