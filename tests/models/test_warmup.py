"""LLM.warmup (entrypoints/warmup.py): its stages, that it leaves nothing behind, and that later
outputs do not depend on it. The GPU side (every decode bucket captured, no plan made afterwards)
is tests/gpu/test_warmup_gpu.py."""
import io
import random

import pytest

import graphdsl as gd
from graphdsl.entrypoints.warmup import WarmupReport, decode_buckets
from graphdsl.layers import Phase
from graphdsl.runtime.serving.cuda_graphs import BUCKETS
from graphdsl.runtime.serving.prefill_pad import token_buckets

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)


def make(**kw):
    return gd.LLM.from_config(CONFIG, device="cpu", dtype="float32", seed=3, **kw)


def requests():
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    params = [gd.SamplingParams(max_tokens=6, ignore_eos=True, temperature=0),
              gd.SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_k=20, top_p=0.9, seed=11,
                                presence_penalty=0.5, frequency_penalty=0.3),
              gd.SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=5, logprobs=2)]
    return prompts, params


def outputs(llm):
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(*requests())]


def test_decode_buckets_reach_the_bucket_holding_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(4) == [1, 2, 4]
    assert decode_buckets(5) == [1, 2, 4, 8]
    assert decode_buckets(10_000) == list(BUCKETS)       # past the largest bucket decode runs eagerly


def test_warmup_runs_its_stages_and_leaves_the_pool_free():
    llm = make(max_model_len=96, max_num_seqs=3, max_num_batched_tokens=40)
    log = io.StringIO()
    report = llm.warmup(stream=log)
    assert isinstance(report, WarmupReport)
    assert [label for label, _ in report.stages] == ["prefill of 40 tokens in 3 prompts", "decode batch 1", "decode batch 2",
                                                     "decode batch 4"]
    assert report.seconds >= sum(s for _, s in report.stages) > 0
    lines = log.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"warm-up {k}/4" for k in range(1, 5)]
    assert "\r" not in log.getvalue()                        # plain lines: clean in a log file
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks
    assert str(report).startswith("warmed up 4 stages in ")


def test_outputs_after_warmup_equal_a_fresh_llm():
    cold = outputs(make(max_model_len=64, max_num_seqs=2))
    warm = make(max_model_len=64, max_num_seqs=2)
    warm.warmup(stream=None)
    assert outputs(warm) == cold


def test_a_warmup_that_turned_dry_compiles_once_and_runs_its_stages_again(monkeypatch):
    """Where kernels compile ahead (CUDA) the stages run in one watch (precompile.run_ahead). Faked
    here: the watch turns dry at once, as with a cold Triton cache — the stages run inside a real
    dry pass (the draws read back token 0), are marked dry, the round is reported, and the stages
    run again for real, leaving the pool free and later outputs a fresh LLM's. A watch that ran
    through (every kernel on disk) runs them once."""
    pytest.importorskip("triton")
    from graphdsl.entrypoints import warmup as warmup_module
    from graphdsl.runtime import precompile
    cold = outputs(make(max_model_len=64, max_num_seqs=2))
    watches = []

    def run_ahead(stages, label, *, dry):
        watches.append(label)
        if not dry:
            stages()
            return None
        with precompile.defer_launches():
            stages()
        return precompile.AheadReport(label, deferred=5, compiled=5, workers=4)
    for dry in (True, False):
        monkeypatch.setattr(warmup_module, "_compiles_ahead", lambda llm: True)
        monkeypatch.setattr(precompile, "run_ahead", lambda stages, label, dry=dry: run_ahead(stages, label, dry=dry))
        llm = make(max_model_len=64, max_num_seqs=2)
        log = io.StringIO()
        report = llm.warmup(stream=log)
        labels = [label for label, _ in report.stages]
        plain = ["prefill of 126 tokens in 2 prompts", "decode batch 1", "decode batch 2"]
        if dry:
            assert labels == [f"{x} (dry: recording the kernels to compile)" for x in plain] + \
                ["5 kernels missing from Triton's cache compiled on 4 workers"] + plain
            assert report.ahead.compiled == 5
            lines = log.getvalue().splitlines()
            assert lines[3] == "warm-up: compiling the kernels missing from Triton's cache on worker processes ..."
            assert lines[4].startswith("warm-up: 5 kernels missing from Triton's cache compiled on 4 workers in ")
            assert [line.split(":")[0] for line in lines[5:]] == [f"warm-up {k}/3" for k in (1, 2, 3)]
        else:
            assert labels == plain and report.ahead is None
        assert report.seconds >= sum(s for _, s in report.stages) > 0
        assert llm.blocks.num_free_blocks == llm.blocks.num_blocks
        monkeypatch.undo()
        assert outputs(llm) == cold
    assert watches == ["warm-up", "warm-up"]


def test_a_dry_warmup_skips_the_repeated_bucket_steps(monkeypatch):
    """Stage 2 runs each prefill bucket twice, the second time to capture its graph. A dry pass
    captures nothing, so there the repeat is skipped; the real pass after the round runs both."""
    pytest.importorskip("triton")
    from graphdsl.entrypoints import warmup as warmup_module
    from graphdsl.runtime import precompile
    monkeypatch.setattr(warmup_module, "prefill_buckets_enabled", lambda device: True)
    monkeypatch.setattr(warmup_module, "_compiles_ahead", lambda llm: True)

    def run_ahead(stages, label):
        with precompile.defer_launches():
            stages()
        return precompile.AheadReport(label, dry_error="ValueError: a dry-only failure")
    monkeypatch.setattr(precompile, "run_ahead", run_ahead)
    llm = make(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=40)
    calls = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda *a, **k: (calls.append(precompile.dry_pass_running()),
                                                          generate(*a, **k))[1])
    report = llm.warmup(stream=None)
    buckets = len(token_buckets(40))
    stage2 = [label for label, _ in report.stages if label.startswith("prefill graphs")]
    assert stage2 == [f"prefill graphs of {buckets} token buckets (dry: recording the kernels to compile)",
                      f"prefill graphs of {buckets} token buckets"]
    assert any(label.endswith("(the dry stages stopped early: ValueError: a dry-only failure)")
               for label, _ in report.stages)
    dry, real = calls.count(True), calls.count(False)
    assert real - dry == buckets > 1                 # the same stages, less one step of each bucket


@pytest.mark.parametrize("max_model_len", [2, 5])
def test_warmup_fits_a_short_context(max_model_len):
    llm = make(max_model_len=max_model_len, max_num_seqs=2)
    report = llm.warmup(stream=None)
    assert report.stages[0][0] == f"prefill of {2 * (max_model_len - 1)} tokens in 2 prompts"   # 2 full prompts
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks


@pytest.mark.parametrize("max_model_len,budget", [(96, 40), (24, 60)])     # one prompt fills a step; three do
def test_with_prefill_buckets_every_step_after_warmup_reuses_a_plan(monkeypatch, max_model_len, budget):
    """Where the loop pads prefill steps (CUDA; here forced on the CPU), a step's shape signature is its
    token bucket alone (sequences and projected rows padded to the loop's count), and the warm-up plans
    every bucket: afterwards requests of any lengths and batch mixes make no new prefill plan."""
    monkeypatch.setenv("GRAPHDSL_PREFILL_BUCKETS", "1")
    llm = make(max_model_len=max_model_len, max_num_seqs=3, max_num_batched_tokens=budget)
    report = llm.warmup(stream=None)
    buckets = token_buckets(budget)
    assert report.stages[1][0] == f"prefill graphs of {len(buckets)} token buckets"
    prefill = llm.model.engine(Phase.PREFILL)
    assert len(prefill._plans) == len(buckets)
    rng = random.Random(0)
    for _ in range(6):
        prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(1, max_model_len - 5))]
                   for _ in range(rng.randint(1, 5))]
        llm.generate(prompts, gd.SamplingParams(max_tokens=rng.randint(1, 4), temperature=0, ignore_eos=True))
    assert len(prefill._plans) == len(buckets)
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks


def test_wider_block_tables_get_prompts_one_table_too_long_for_the_narrower():
    """Stage 4: for each decode graph width past a bucket's narrowest, prompts whose decode rows need
    one block more than the next narrower table holds; none past max_model_len."""
    from types import SimpleNamespace

    from graphdsl.entrypoints.warmup import _wider_tables
    executor = SimpleNamespace(block_size=16, decode_widths=lambda n: (32, 64, 129) if n <= 2 else (129,))
    llm = SimpleNamespace(_executor=executor, max_model_len=2049)
    calls = _wider_tables(llm, 2, 1000)
    assert [[len(p) for p in prompts] for prompts, _ in calls] == [[512, 512], [1024, 1024]]
    assert all(sp.max_tokens == 3 and sp.temperature == 0 and sp.ignore_eos for _, sp in calls)
    assert all(-(-(len(p[0]) + 1) // 16) == w + 1 for (p, _), w in zip(calls, (32, 64)))   # one block past
    assert _wider_tables(llm, 4, 1000) == []
    assert len(_wider_tables(SimpleNamespace(_executor=executor, max_model_len=1000), 1, 1000)) == 1
    no_graphs = SimpleNamespace(block_size=16, decode_widths=lambda n: ())
    assert _wider_tables(SimpleNamespace(_executor=no_graphs, max_model_len=99), 1, 9) == []
