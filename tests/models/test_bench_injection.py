"""benchmarks/injection.py end to end on a tiny Qwen2-MoE shape on the CPU: both runs load, decode,
agree on greedy tokens, and the table prints; the benchmark's shape is the published one."""
import math
import time

import pytest

from tests.helpers import benchmarks
from tests.models.hf_tiny import make_config


@pytest.fixture(scope="module")
def bench():
    return benchmarks.load("injection")


def _timer(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_runs_end_to_end_on_a_tiny_cpu_shape(bench):
    hf = make_config("qwen2_moe").to_dict()
    kw = dict(device="cpu", dtype="float32", context=40, tokens=5, timer=_timer)
    gpu, cpu = bench.measure(hf, None, **kw), bench.measure(hf, bench.experts_cpu_rules(1), **kw)
    assert gpu["tokens"] == cpu["tokens"] and len(gpu["tokens"]) == 5
    assert gpu["ms"] > 0 and cpu["ms"] > 0
    text = bench.table(gpu, cpu, layers=2, dtype="float32", context=40, threads=1, device="cpu")
    assert "| CPU " in text and "greedy tokens (5) equal: True" in text


def test_shape_is_qwen1_5_moe_a2_7b(bench):
    from graphdsl.models import build_config, resolve_model_class
    cfg = build_config(dict(bench.QWEN2_MOE))
    model = resolve_model_class(cfg.model_type, cfg.architectures)(cfg)
    total = sum(math.prod(p.shape) for p in model.parameters())
    assert total == 14_315_784_192          # Qwen1.5-MoE-A2.7B's 14.3B parameters (config.json geometry)
