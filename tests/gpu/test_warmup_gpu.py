"""LLM.warmup on a GPU (run with ``pytest -m gpu``): afterwards every decode bucket up to
max_num_seqs replays a captured graph, the engines' arenas no longer grow, and a batch of
requests of the warmed shapes makes no new decode plan; the warm-up's time and the first batch's
time after it are printed."""
from __future__ import annotations

import time

import pytest
import torch

import graphdsl as gd
from graphdsl.layers import Phase

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)


def test_warmup_captures_every_decode_bucket_and_sizes_the_arenas():
    llm = gd.LLM.from_config(CONFIG, device="cuda", dtype="bfloat16", seed=0, max_model_len=256, max_num_seqs=6,
                             max_num_batched_tokens=128)
    report = llm.warmup(stream=None)
    (runner,) = llm.model._graph_runners.values()
    assert sorted(runner.graphs) == [(1, 16), (2, 16), (4, 16), (8, 16)]
    decode = llm.model.engine(Phase.DECODE)
    plans = len(decode._plans)
    arenas = {id(e): e.arena_id(torch.device("cuda")) for e in (decode, llm.model.engine(Phase.PREFILL))}
    t = time.perf_counter()
    outs = llm.generate([[7 + i] * (5 + 3 * i) for i in range(6)], gd.SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True))
    first = time.perf_counter() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 6
    assert len(decode._plans) == plans                   # every decode bucket was planned by the warm-up
    assert {id(e): e.arena_id(torch.device("cuda")) for e in (decode, llm.model.engine(Phase.PREFILL))} == arenas
    assert sorted(runner.graphs) == [(1, 16), (2, 16), (4, 16), (8, 16)]
    print(f"\n{report}; first batch after it {first * 1e3:.1f} ms")


def test_warmup_captures_the_wider_block_tables_too(monkeypatch):
    """Where decode graphs narrow their block table at short contexts, the warm-up also captures
    each bucket's wider tables: later requests whose contexts cross them plan and capture nothing."""
    import importlib
    pa = importlib.import_module("graphdsl.runtime.kernels.paged_attention")
    monkeypatch.setattr(pa, "WIDTH_FLOOR_KEYS", 64)
    llm = gd.LLM.from_config(CONFIG, device="cuda", dtype="bfloat16", seed=0, max_model_len=512, max_num_seqs=2,
                             max_num_batched_tokens=1024, block_size=8)
    report = llm.warmup(stream=None)
    assert any("wider block tables" in label for label, _ in report.stages), report
    (runner,) = llm.model._graph_runners.values()
    want = {(b, w) for b in (1, 2) for w in runner.widths(b)}
    assert len(runner.widths(1)) > 2 and set(runner.graphs) == want
    decode = llm.model.engine(Phase.DECODE)
    plans = len(decode._plans)
    outs = llm.generate([[5] * 30, [6] * 300], gd.SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [150, 150]
    assert len(decode._plans) == plans and set(runner.graphs) == want


def test_steps_inside_a_dry_pass_capture_no_graph():
    """A warm-up's watch that turned dry (runtime/precompile.py) runs its steps launching nothing:
    neither graph runner may keep a graph captured then (it would replay nothing). The requests
    read back token 0; the same requests outside it capture the graphs and get a fresh LLM's tokens."""
    from graphdsl.runtime import precompile
    prompts = [[5 + i] * (4 + 7 * i) for i in range(3)]
    params = gd.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def make():
        return gd.LLM.from_config(CONFIG, device="cuda", dtype="bfloat16", seed=0, max_model_len=256, max_num_seqs=4,
                                  max_num_batched_tokens=128)
    want = [o.outputs[0].token_ids for o in make().generate(prompts, params)]
    llm = make()
    with precompile.defer_launches():
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [[0] * 6] * 3
    runners = list(llm.model._graph_runners.values())
    assert runners and all(not r.graphs for r in runners)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert any(r.graphs for r in runners)


_COLD_WARMUP = """
import json, sys
import graphdsl as gd
from graphdsl.runtime import precompile
config = json.loads(sys.argv[1])
def make():
    return gd.LLM.from_config(config, device="cuda", dtype="bfloat16", seed=0, max_model_len=256, max_num_seqs=4,
                              max_num_batched_tokens=128)
llm = make()
report = llm.warmup(stream=None)
again = llm.warmup(stream=None)
rounds = [r.label for r in precompile.history]
params = gd.SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=1, ignore_eos=True)
prompts = [[5 + i] * (4 + 7 * i) for i in range(3)]
tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
plain = [o.outputs[0].token_ids for o in make().generate(prompts, params)]
print(json.dumps({"ahead": None if report.ahead is None else [report.ahead.compiled, len(report.ahead.failed)],
                  "again": again.ahead is not None, "rounds": rounds,
                  "stages": [label for label, _ in report.stages], "same": tokens == plain}))
"""


def test_a_cold_warmup_compiles_its_kernels_in_one_round(tmp_path):
    """With empty caches (a fresh process) the warm-up turns dry at its first missing kernel,
    compiles every kernel the rest of it would meet in one round, then runs its stages for real; a
    second warm-up finds every kernel and runs through. Generations after it are a fresh LLM's."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), GRAPHDSL_CACHE_DIR=str(tmp_path / "engines"),
               GRAPHDSL_KERNEL_CACHE=str(tmp_path / "kernels"), GRAPHDSL_COMPILE_WORKERS="8")
    proc = subprocess.run([sys.executable, "-c", _COLD_WARMUP, json.dumps(CONFIG)], env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\n", out)
    compiled, failed = out["ahead"]
    assert compiled > 10 and failed == 0
    assert out["rounds"] == ["warm-up"]              # one round: no plan or draw of the stages made its own
    assert any("(dry" in s for s in out["stages"]) and not out["again"] and out["same"]
