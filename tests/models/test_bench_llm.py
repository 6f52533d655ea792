"""benchmarks/llm.py (``graphdsl bench``): the shape table holds the published models, the byte and
FLOP counts follow from it, and the whole measurement runs end to end on a tiny shape on the CPU."""
import pathlib
import time

import pytest
import torch

from graphdsl.models import build_config, resolve_model_class
from graphdsl.entrypoints.cli import bench_script_path, build_parser
from tests.helpers import benchmarks
from tests.helpers.soak import TINY_LLAMA


@pytest.fixture(scope="module")
def bench():
    assert pathlib.Path(bench_script_path()) == benchmarks.ROOT / "llm.py"
    return benchmarks.load("llm")


# total parameters as published on each model's card (embedding counted once when tied)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360}


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_shapes_have_the_published_parameter_counts(bench, shape):
    config = build_config(bench.SHAPES[shape])
    model = resolve_model_class(config.model_type, config.architectures)(config, torch.bfloat16)
    w = bench.weight_bytes(model)
    total = w["embedding"] + w["layers"] + (0 if config.tie_word_embeddings else w["lm_head"])
    assert total // 2 == PUBLISHED[shape]
    assert w["lm_head"] == w["embedding"]          # decode reads lm_head even when it is the embedding


def test_byte_and_flop_counts(bench):
    config = build_config(bench.SHAPES["llama-3-8b"])
    w = {"embedding": 1, "lm_head": 10, "layers": 100}
    kv = 2 * 32 * 8 * 128 * 2
    assert kv == 131072
    assert bench.decode_bytes(w, kv, batch=2, context=512) == 110 + 2 * 512 * kv
    flops = bench.prefill_flops(config, {"layers": 2 * 1000}, 2, tokens=4)
    assert flops == 2 * 1000 * 4 + 2 * 128256 * 4096 + 32 * 4 * 32 * 128 * 10


def test_routed_experts_count_by_expected_use(bench):
    """A step reads the fraction 1 - (1 - k/E)^batch of the routed experts: Mixtral's 2 of 8 at batch 1
    reads a quarter; prefill FLOPs count k/E of them."""
    config = build_config(bench.SHAPES["mixtral-8x7b"])
    model = resolve_model_class(config.model_type, config.architectures)(config, torch.bfloat16)
    w = bench.weight_bytes(model)
    assert w["experts"] == 2 * 32 * 8 * 3 * 4096 * 14336
    assert bench.expert_fraction(config, 1) == 0.25 and bench.expert_fraction(config, 2) == 1 - 0.75 ** 2
    assert bench.decode_bytes(w, 0, 1, 512, bench.expert_fraction(config, 1)) == \
        w["layers"] + w["lm_head"] + w["experts"] // 4
    dense = {"layers": w["layers"]}
    assert bench.prefill_flops(config, {**dense, "experts": w["experts"]}, 2, 8) == \
        bench.prefill_flops(config, {"layers": w["layers"] + w["experts"] // 4}, 2, 8)
    assert bench.expert_fraction(build_config(bench.SHAPES["llama-3-8b"]), 1) == 1.0


def test_cli_offers_every_shape(bench):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    shape = next(a for a in sub.choices["bench"]._actions if a.dest == "shape")
    assert sorted(shape.choices) == sorted(bench.SHAPES)


def test_runs_end_to_end_on_a_tiny_cpu_shape(bench):
    def timer(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    res = bench.measure_graphdsl("tiny", hf=TINY_LLAMA, device="cpu", dtype="float32", timer=timer, batches=(1, 3),
                                 e2e_batches=(2,), e2e_tokens=3, context=24, prefill=40)
    assert set(res["decode"]) == {1, 3} and set(res["e2e"]) == {2} and res["prefill_ms"] > 0
    peer = bench.measure_peer("tiny", hf=TINY_LLAMA, device="cpu", dtype=torch.float32, timer=timer,
                              compile_mode=None, context=24)
    text = bench.table(res, 100.0, 10.0, peer, "cpu")
    assert "| decode batch 3, ctx 24" in text and "| prefill 40 tokens" in text
    assert set(res["first_token"]) == {2} and res["first_token"][2] > 0
    assert "| LLM.generate greedy batch 2, prompt 23, first token: ms" in text
    assert "graphdsl/peer time ratio" in text and "cold build decode + prefill engines" in text
    assert res["triton_new"] == 0 and "no Triton compile) | build target" in text   # the CPU backend is torch's


def test_triton_cache_entries_count_the_cache_directory(bench, tmp_path, monkeypatch):
    """The cold build names how many Triton cache entries its first steps wrote (a fresh machine
    compiles every kernel; a warm Triton cache none), counted in Triton's cache directory."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert bench.triton_cache_entries() == 0                 # not made yet
    for name in ("kernel-hash", "launcher-hash"):
        (tmp_path / "triton" / name).mkdir(parents=True)
    assert bench.triton_cache_entries() == 2
    res = {"cold": dict(decode_build=0.4, decode_first_step=8.6, prefill_build=0.2, prefill_first_step=5.2),
           "triton_new": 34}
    row = next(line for line in bench.build_rows(res) if line.startswith("| cold build"))
    assert "(+ first steps 13.80; 34 new Triton cache entries: kernels compiled, launchers built)" in row
    res["ahead"] = {"compiled": 15, "workers": 8}
    row = next(line for line in bench.build_rows(res) if line.startswith("| cold build"))
    assert "launchers built; 15 of the kernels compiled ahead on 8 workers)" in row


def test_decode_timeline_increments_add_up_to_the_critical_path():
    """benchmarks/decode_timeline.py: overlapping (PDL) kernels are charged only what they add past
    the latest end before them, so the increments sum to the last end minus the first."""
    mod = benchmarks.load("decode_timeline")
    events = [{"name": "_gemv_kernel_0d1d(...)", "ts": 0.0, "dur": 10.0},
              {"name": "fused_kernel_abc", "ts": 2.0, "dur": 9.0},          # waits, ends 1 after the GEMV
              {"name": "_decode_kernel", "ts": 3.0, "dur": 5.0},            # ends inside: adds nothing
              {"name": "_gemv_kernel_0d1d(...)", "ts": 11.5, "dur": 4.0}]
    inc, dur, calls = mod.increments(events)
    assert inc == {"fused_kernel": 1.0, "_decode_kernel": 0.0, "_gemv_kernel": 4.5}
    assert sum(inc.values()) == 15.5 - 10.0 and calls["_gemv_kernel"] == 2 and dur["_gemv_kernel"] == 14.0
    assert mod.family("void at::native::vectorized_elementwise_kernel<4, X>(int)") == \
        "void at::native::vectorized_elementwise_kernel<4, X>"[:50]
