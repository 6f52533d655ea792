"""Taps on a real GPU (``pytest -m gpu``): eager taps of the Triton engine equal the torch reference
of the same graph, and under CUDA-graph replay the static tap buffers hold each replay's values
(the same as an eager step with taps), with the launch count unchanged."""
from __future__ import annotations

import pytest
import torch

from graphdsl.runtime.serving.cuda_graphs import CudaGraphRunner, Pad
from tests.core.test_taps import _mlp_engine, _reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_cuda_graph_replay_refreshes_static_taps():
    engine = _mlp_engine(backend="triton", device="cuda", cache=False)
    engine.set_weights({k: v.cuda() for k, v in engine._weights.items()})
    launches = engine.num_launches
    runner = CudaGraphRunner(engine, {"x": Pad(0.0)}, buckets=(4, 8), taps="module:layers.*")
    for n in (3, 5, 3):
        x = torch.randn(n, 8, device="cuda")
        out = runner.run({"x": x})["y"]
        assert runner.tapped, "the runner kept no taps"
        eager = engine.forward({"x": x}, taps="module:layers.*")["y"]
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        ref = _reference(engine, {"x": x})
        for name, buf in runner.tapped.items():
            torch.testing.assert_close(buf[:n], engine.tapped[name], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(buf[:n], ref[name], rtol=1e-4, atol=1e-4)
    assert engine.num_launches == launches
