"""engine.profile(): one row per launch (views excluded) with fused ops, times that add up to the
step, work counted from the shapes, and Chrome-trace / SVG files; on CPU (torch backend)."""
import json

import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.profile import Ceilings
from tests.core.test_taps import _mlp_engine
from tests.helpers import tiny_block


def test_profile_rows_match_launches_and_work(tmp_path):
    engine = _mlp_engine()
    x = torch.randn(16, 8)
    report = engine.profile({"x": x}, iters=3, ceilings=Ceilings(gbps=10.0, tflops=0.1))
    assert len(report.rows) == engine.num_launches
    assert [r.ms for r in report.rows] == sorted((r.ms for r in report.rows), reverse=True)
    assert all(r.ms > 0 and 0 < r.share for r in report.rows)
    by_op = {r.op: r for r in report.rows}
    gate_up = by_op["matmul_silu_mul"]
    assert gate_up.fused == ("matmul", "silu", "mul")
    assert gate_up.tflop * 1e12 == pytest.approx(2 * 16 * 32 * 8)
    # bytes: x [16, 8] + gate_up [32, 8] in, [16, 16] out, float32
    assert gate_up.gbytes * 1e9 == pytest.approx(4 * (16 * 8 + 32 * 8 + 16 * 16))
    assert gate_up.ceiling == pytest.approx(max(gate_up.gbps / 10.0, gate_up.tflops / 0.1))
    text = str(report)
    assert "matmul_silu_mul" in text and "kernels sum" in text
    trace = json.loads(report.chrome_trace(tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["name"] for e in trace] == report.order and len(trace) == engine.num_launches
    assert all(b["ts"] >= a["ts"] + a["dur"] - 1e-3 for a, b in zip(trace, trace[1:]))
    svg = report.svg(tmp_path / "p.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == len(report.rows)


def test_profile_sums_to_the_step_and_counts_attention_cache_rows():
    engine = tiny_block.build().build_engine()
    engine.set_weights(tiny_block.weights())
    feed = tiny_block.inputs(12)
    report = engine.profile(feed, iters=5, ceilings=Ceilings(50.0, 0.5))
    assert len(report.rows) == engine.num_launches
    assert report.step_ms > 0 and report.kernel_ms > 0      # (CPU times on a shared runner are too noisy to compare)
    assert {r.fused for r in report.rows if r.op == "add_rms_norm"} == {("add", "rms_norm")}
    attn = next(r for r in report.rows if r.op == "paged_attention")
    row = tiny_block.KV_HEADS * tiny_block.HEAD_DIM * 4
    whole_cache = tiny_block.NUM_BLOCKS * tiny_block.BLOCK * row
    assert attn.gbytes * 1e9 < 2 * whole_cache          # only the 12 cached rows of each cache count
    assert attn.gbytes * 1e9 >= 2 * 12 * row


def test_profile_rejects_bad_options():
    engine = _mlp_engine()
    with pytest.raises(GraphDSLError, match="iters must be an int >= 1, got 0"):
        engine.profile({"x": torch.randn(2, 8)}, iters=0)


def test_gather_counts_the_rows_it_reads():
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    with Network("emb") as net:
        ids = Tensor("ids", (Dim("n", max=64),), torch.int64)
        table = Tensor("table", (1000, 16), torch.float32)
        net.mark_output(F.embedding(ids, table) * 2.0, "y")
    engine = net.build_engine()
    engine.set_weights({"table": torch.randn(1000, 16)})
    report = engine.profile({"ids": torch.tensor([1, 5, 7])}, iters=1, ceilings=Ceilings(1.0, 1.0))
    emb = next(r for r in report.rows if r.op == "embedding")
    assert emb.gbytes * 1e9 == 3 * 8 + 2 * 3 * 16 * 4          # ids, the 3 rows read, the 3 rows written
