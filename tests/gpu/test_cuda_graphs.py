"""CUDA graphs for decode on a real GPU (run with ``pytest -m gpu``): a replayed bucket equals the
eager step for several buckets and odd batch sizes (3, 5, 33), including later steps that only
replay; greedy generation is the same with and without graphs; replay allocates nothing; and the
decode step time with and without graphs is printed for a small model. Prefill steps padded to
their shapes (``prefill_pad``) replay per-shape graphs: equal to the eager step with new prompts of
the same shape, in ``LLM.generate`` too; their step time is printed."""
from __future__ import annotations

import time

import pytest
import torch

import graphdsl as gd
from graphdsl.layers import Phase
from graphdsl.runtime.serving.prefill_pad import pad_prefill
from tests.models.hf_tiny import make_checkpoint

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
BLOCK = 8


def _step(llm, seq_lens, g):
    """A decode step over random context lengths: sequence s owns consecutive cache blocks."""
    tables, slots, nxt = [], [], 0
    for L in seq_lens:
        n = -(-L // BLOCK)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
        slots.append(tables[-1][(L - 1) // BLOCK] * BLOCK + (L - 1) % BLOCK)
    width = max(map(len, tables))
    step = {"input_ids": torch.randint(0, llm.config.vocab_size, (len(seq_lens),), generator=g),
            "positions": torch.tensor([L - 1 for L in seq_lens]),
            "slot_mapping": torch.tensor(slots),
            "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32)}
    return {k: v.to(DEV) for k, v in step.items()}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("cg")
    make_checkpoint("llama", path)
    return gd.LLM(path, device="cuda", dtype="float32", max_model_len=64, max_num_seqs=40, block_size=BLOCK)


def _run(llm, step, graphs: bool, monkeypatch):
    monkeypatch.setenv("GRAPHDSL_CUDA_GRAPHS", "1" if graphs else "0")
    caches = [c.clone() for c in llm.kv_cache.key_caches + llm.kv_cache.value_caches]
    out = llm.model.execute(Phase.DECODE, step)
    written = [c.clone() for c in llm.kv_cache.key_caches + llm.kv_cache.value_caches]
    for c, b in zip(llm.kv_cache.key_caches + llm.kv_cache.value_caches, caches):
        c.copy_(b)
    return out, written


def _replay_equals_eager(run, llm, step, monkeypatch, tol=1e-4, cache_tol=1e-5):
    """``run(llm, step, graphs, monkeypatch) -> (logits, caches)`` with graphs equals it without."""
    want, want_cache = run(llm, step, False, monkeypatch)
    got, got_cache = run(llm, step, True, monkeypatch)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for a, b in zip(got_cache, want_cache):
        torch.testing.assert_close(a, b, rtol=cache_tol, atol=cache_tol)
    return want, want_cache


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 33])
def test_replay_equals_eager(tiny_llm, n, monkeypatch):
    llm = tiny_llm
    g = torch.Generator().manual_seed(n)
    for c in llm.kv_cache.key_caches + llm.kv_cache.value_caches:
        c.copy_(torch.randn(c.shape, generator=g))
    for rep in range(3):      # first call captures; later ones only replay with new inputs
        lens = torch.randint(1, 64, (n,), generator=g).tolist()
        want, _ = _replay_equals_eager(_run, llm, _step(llm, lens, g), monkeypatch)
        assert want.shape == (n, llm.config.vocab_size)
    (runner,) = llm.model._graph_runners.values()
    assert runner.prologue is not None and not {"cos", "sin"} & set(runner.pads)   # RoPE tables inside the graph
    bucket = next(b for b in runner.buckets if b >= n)
    assert (bucket, 8) in runner.graphs           # the model's width: 64 / 8 (too narrow to narrow further)
    assert runner.graphs[(bucket, 8)].inputs["block_tables"].shape == (bucket, 8)


def test_replay_allocates_nothing(tiny_llm, monkeypatch):
    llm = tiny_llm
    g = torch.Generator().manual_seed(7)
    monkeypatch.setenv("GRAPHDSL_CUDA_GRAPHS", "1")
    llm.model.execute(Phase.DECODE, _step(llm, [5, 9, 20], g))          # bucket 4 captured (or reused)
    (runner,) = llm.model._graph_runners.values()
    entry = runner.graphs[(4, 8)]
    step = _step(llm, [7, 3, 30], g)
    step["cos"], step["sin"] = llm.model.rotary.cos_sin(step["positions"])   # as models/base._execute adds them
    runner._load(entry, {k: step[k] for k in runner.pads}, 3, runner.pads)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    entry.graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_greedy_generate_same_with_and_without_graphs(family, tmp_path):
    make_checkpoint(family, tmp_path)
    prompts = [[1, 5, 9, 33, 2, 77, 100, 3], [4, 5, 6], [7, 8, 9, 10, 11]]
    params = gd.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = gd.LLM(tmp_path, device="cuda", dtype="float32", max_model_len=64, cuda_graphs=graphs)
        outs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runners = llm.model._graph_runners
        assert bool(runners) == graphs and (not graphs or any(r.graphs for r in runners.values()))
    assert outs[True] == outs[False]


def _time_step(llm, phase, step, calls: int) -> float:
    """ms per ``execute(phase, step)`` after three warm-up calls (the first sight of a shape runs
    eagerly, the second captures)."""
    for _ in range(3):
        llm.model.execute(phase, step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        llm.model.execute(phase, step)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def _time_decode(llm, batch: int, steps: int = 50) -> float:
    g = torch.Generator().manual_seed(0)
    return _time_step(llm, Phase.DECODE, _step(llm, [200 + 7 * i for i in range(batch)], g), steps)


def test_print_decode_step_time_with_and_without_graphs(tmp_path, monkeypatch):
    """Not a pass/fail benchmark: prints ms per decode step (= per token at batch 1)."""
    make_checkpoint("llama", tmp_path, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)
    llm = gd.LLM(tmp_path, device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8, block_size=BLOCK)
    lines = []
    for batch in (1, 8):
        ms = {}
        for graphs in (False, True):
            monkeypatch.setenv("GRAPHDSL_CUDA_GRAPHS", "1" if graphs else "0")
            ms[graphs] = _time_decode(llm, batch)
        lines.append(f"decode step, batch {batch}: eager {ms[False]:.3f} ms, cuda graphs {ms[True]:.3f} ms "
                     f"({ms[False] / ms[True]:.1f}x)")
    print(f"\n[{torch.cuda.get_device_name()}] llama 8 layers, hidden 512, vocab 32000, bf16, context ~200:\n  "
          + "\n  ".join(lines))
    assert all(v > 0 for v in ms.values())


def _prefill(llm, lens, g):
    """A prefill step of prompts of these lengths (cache blocks consecutive, the last row of each
    projected), padded to its shapes as the serving loop pads it."""
    tables, slots, pos, nxt = [], [], [], 0
    for L in lens:
        n = -(-L // BLOCK)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
        slots += [tables[-1][p // BLOCK] * BLOCK + p % BLOCK for p in range(L)]
        pos += range(L)
    width = max(map(len, tables))
    qsl = [0]
    for L in lens:
        qsl.append(qsl[-1] + L)
    step = {"input_ids": torch.randint(0, llm.config.vocab_size, (qsl[-1],), generator=g),
            "positions": torch.tensor(pos), "slot_mapping": torch.tensor(slots),
            "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            "seq_lens": torch.tensor(lens, dtype=torch.int32), "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
            "lm_head_indices": torch.tensor(qsl[1:]) - 1}
    padded, _ = pad_prefill({k: v.to(DEV) for k, v in step.items()}, llm.model._runtime["max_blocks_per_seq"])
    return padded


def _run_prefill(llm, step, graphs: bool, monkeypatch):
    monkeypatch.setenv("GRAPHDSL_PREFILL_GRAPHS", "1" if graphs else "0")
    caches = llm.kv_cache.key_caches + llm.kv_cache.value_caches
    before = [c.clone() for c in caches]
    out = llm.model.execute(Phase.PREFILL, step)
    written = [c.clone() for c in caches]
    for c, b in zip(caches, before):
        c.copy_(b)
    return out, written


def test_prefill_replay_equals_eager(tiny_llm, monkeypatch):
    """Prompts of new lengths and tokens but the same padded shapes: the first step runs eagerly,
    the second is captured, the rest replay; every one equals the eager step (logits and cache)."""
    llm = tiny_llm
    g = torch.Generator().manual_seed(11)
    for lens in ([5, 11], [9, 7], [3, 13], [12, 4]):           # 16 tokens, 2 sequences, 2 blocks each at most
        _, want_cache = _replay_equals_eager(_run_prefill, llm, _prefill(llm, lens, g), monkeypatch, 1e-5, 1e-6)
        assert not all(torch.equal(a, b) for a, b in zip(want_cache, llm.kv_cache.key_caches))
    (runner,) = llm.model._prefill_runners.values()
    (entry,) = runner.graphs.values()
    assert entry.graph is not None and entry.inputs["input_ids"].shape == (16,)


def test_a_prefill_capture_after_an_eager_step_runs_no_extra_forward_and_empties_no_cache(tiny_llm, monkeypatch):
    """A shape's second sighting is captured straight away: its first, eager step made the plan
    and compiled the kernels, so the capture takes the engine's output buffers instead of one more
    eager forward; and it neither empties torch's caches nor waits for the device, as
    ``torch.cuda.graph`` does (a warm-up captures ~60 prefill graphs in a row)."""
    llm = tiny_llm
    g = torch.Generator().manual_seed(23)
    first, second = _prefill(llm, [21, 20], g), _prefill(llm, [25, 16], g)      # 41 tokens: bucket 44
    engine = llm.model.engine(Phase.PREFILL)
    runner = llm.model._prefill_runners.get(id(engine))
    def bucket_44(sigs):      # a runner's signatures hold the model's inputs too (cos, sin)
        return [sig for sig in sigs if dict((k, shape) for k, shape, *_ in sig)["input_ids"] == (44,)]
    if runner is not None:
        assert not bucket_44(runner.seen)
    forwards, emptied = [], []
    real = engine.forward
    monkeypatch.setattr(engine, "forward", lambda *a, **k: forwards.append(1) or real(*a, **k))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    _run_prefill(llm, first, True, monkeypatch)                     # eager: the plan, the kernels
    got, got_cache = _run_prefill(llm, second, True, monkeypatch)   # captured, then replayed
    assert len(forwards) == 2 and not emptied
    (runner,) = llm.model._prefill_runners.values()
    assert len(bucket_44(runner.graphs)) == 1
    want, want_cache = _run_prefill(llm, second, False, monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_cache, want_cache):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_generate_with_prefill_graphs_gives_the_eager_tokens(tmp_path, monkeypatch):
    """The same prompts generated twice (the second prefill replays the graph the first sighting
    did not capture) give the tokens of prefill run eagerly."""
    make_checkpoint("llama", tmp_path)
    prompts = [[1, 5, 9, 33, 2, 77, 100, 3], [4, 5, 6], [7, 8, 9, 10, 11]]
    params = gd.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        monkeypatch.setenv("GRAPHDSL_PREFILL_GRAPHS", "1" if graphs else "0")
        llm = gd.LLM(tmp_path, device="cuda", dtype="float32", max_model_len=64)
        outs[graphs] = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for _ in range(3)]
        assert bool(llm.model._prefill_runners) == graphs
        assert not graphs or any(r.graphs for r in llm.model._prefill_runners.values())
    assert outs[True] == outs[False] and outs[False][0] == outs[False][2]


def test_print_prefill_step_time_with_and_without_graphs(tmp_path, monkeypatch):
    """Not a pass/fail benchmark: prints ms per prefill step of short prompts, eager and replayed."""
    make_checkpoint("llama", tmp_path, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)
    llm = gd.LLM(tmp_path, device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8, block_size=BLOCK)
    g = torch.Generator().manual_seed(0)
    lines = []
    for tokens in (16, 128):
        step = _prefill(llm, [tokens], g)
        ms = {}
        for graphs in (False, True):
            monkeypatch.setenv("GRAPHDSL_PREFILL_GRAPHS", "1" if graphs else "0")
            ms[graphs] = _time_step(llm, Phase.PREFILL, step, 20)
        lines.append(f"prefill step, {tokens} tokens: eager {ms[False]:.3f} ms, cuda graph {ms[True]:.3f} ms "
                     f"({ms[False] / ms[True]:.1f}x)")
    print(f"\n[{torch.cuda.get_device_name()}] llama 8 layers, hidden 512, vocab 32000, bf16:\n  " + "\n  ".join(lines))
    assert all(v > 0 for v in ms.values())


def test_a_regrown_arena_recaptures_the_prefill_graphs_of_the_old_one(tiny_llm, monkeypatch):
    """A longer prompt regrows the prefill engine's arena; the graph of a short shape captured on the
    old arena is captured again the next time (the old arena is then let go), and still gives the
    eager step's logits."""
    llm = tiny_llm
    g = torch.Generator().manual_seed(12)
    short = lambda: _prefill(llm, [6, 10], g)              # noqa: E731 - 16 tokens, 2 sequences
    first = short()
    for _ in range(3):
        _run_prefill(llm, first, True, monkeypatch)          # (seen,) captured, replayed
    runner = next(iter(llm.model._prefill_runners.values()))
    (sig,) = [k for k, v in runner.graphs.items()                # the model adds inputs (cos/sin) to the step
              if all(v.inputs[n].shape == first[n].shape for n in ("input_ids", "block_tables", "seq_lens"))]
    old = runner.graphs[sig]
    before = runner.engine.arena_id(DEV)
    _run_prefill(llm, _prefill(llm, [40, 24], g), True, monkeypatch)   # 64 tokens: a larger plan
    assert runner.engine.arena_id(DEV) != before and old.arena == before
    step = short()
    want, _ = _run_prefill(llm, step, False, monkeypatch)
    got, _ = _run_prefill(llm, step, True, monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert runner.graphs[sig] is not old and runner.graphs[sig].arena == runner.engine.arena_id(DEV)


def test_prefill_graphs_capture_again_after_the_arena_regrows(tiny_llm, monkeypatch):
    """A larger step regrows the engine's arena and drops every prefill graph, with them the last
    users of their memory pool; a shape seen again is captured into a fresh pool. (Into the old
    one the capture failed on the allocator's "use_count > 0" assert, and the shape then ran
    eagerly for good: 24-31 shapes a `benchmarks/serve.py` run on an H200.)"""
    llm = tiny_llm
    monkeypatch.setenv("GRAPHDSL_PREFILL_GRAPHS", "1")
    g = torch.Generator().manual_seed(5)
    caches = [c.clone() for c in llm.kv_cache.key_caches + llm.kv_cache.value_caches]
    for _ in range(2):                                            # 16 tokens, 2 sequences: captured
        llm.model.execute(Phase.PREFILL, _prefill(llm, [6, 10], g))
    (runner,) = llm.model._prefill_runners.values()
    assert runner.graphs and not runner.failed
    arena = runner.engine.arena_id(DEV)
    llm.model.execute(Phase.PREFILL, _prefill(llm, [60] * 30, g))    # first sight: eager, regrows the arena
    assert runner.engine.arena_id(DEV) != arena, "the 1800-token step did not regrow the arena"
    for lens in ([7, 9], [8, 8]):                                 # the 16-token shape: captured again, replayed
        step = _prefill(llm, lens, g)
        want, _ = _run_prefill(llm, step, False, monkeypatch)
        got, _ = _run_prefill(llm, step, True, monkeypatch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not runner.failed
    assert [e.inputs["input_ids"].shape for e in runner.graphs.values()] == [(16,)]
    for c, b in zip(llm.kv_cache.key_caches + llm.kv_cache.value_caches, caches):
        c.copy_(b)


@pytest.fixture
def long_llm(monkeypatch):
    """A tiny model with a 1024-token table (128 blocks of 8) whose decode graphs narrow from 8
    blocks up (``WIDTH_FLOOR_KEYS`` 64 for the test)."""
    import importlib
    pa = importlib.import_module("graphdsl.runtime.kernels.paged_attention")
    monkeypatch.setattr(pa, "WIDTH_FLOOR_KEYS", 64)
    config = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    return gd.LLM.from_config(config, device="cuda", dtype="float32", seed=0, max_model_len=1024, max_num_seqs=4,
                              block_size=BLOCK)


def test_narrower_block_tables_replay_their_own_graphs(long_llm, monkeypatch):
    """A decode step's table picks the narrowest graph of its bucket holding it (fewer attention
    programs at short contexts); each equals the eager step."""
    llm = long_llm
    g = torch.Generator().manual_seed(11)
    for c in llm.kv_cache.key_caches + llm.kv_cache.value_caches:
        c.copy_(torch.randn(c.shape, generator=g))
    for lens in ([40], [200], [900], [30, 500], [60]):
        _replay_equals_eager(_run, llm, _step(llm, lens, g), monkeypatch)
    (runner,) = llm.model._graph_runners.values()
    widths = runner.widths(1)
    assert len(widths) > 2 and widths[-1] == 128, widths
    for (bucket, width), entry in runner.graphs.items():
        assert entry.inputs["block_tables"].shape == (bucket, width)
    assert {w for b, w in runner.graphs if b == 1} == {runner.width_for(1, -(-L // BLOCK)) for L in (40, 200, 900)}


def test_generate_moves_across_block_table_widths(long_llm, monkeypatch):
    """Greedy generation whose contexts cross several graph widths (the loop moves its rows to a
    wider graph as they grow) gives the tokens of eager decode, with the overlap on."""
    llm = long_llm
    params = gd.SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    prompts = [[3 + i] * (40 + 50 * i) for i in range(3)]
    monkeypatch.setenv("GRAPHDSL_CUDA_GRAPHS", "0")
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv("GRAPHDSL_CUDA_GRAPHS", "1")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    (runner,) = llm.model._graph_runners.values()
    assert len({w for b, w in runner.graphs if b == 4}) >= 2, sorted(runner.graphs)
