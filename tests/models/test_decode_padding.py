"""CUDA-graph bucketing and padding, checked on CPU: a decode step padded to its bucket (rows with
slot -1 and seq_len 0, block tables widened to the fixed width) gives the real rows' logits and
cache writes of the unpadded step."""
import pytest
import torch

import graphdsl as gd
from graphdsl.errors import BindError, GraphDSLError
from graphdsl.layers import Phase
from graphdsl.models.base import cuda_graphs_enabled, decode_pads
from graphdsl.runtime.serving.cuda_graphs import BUCKETS, CudaGraphRunner, Pad, bucket_for, pad_batch
from tests.models.hf_tiny import make_checkpoint


def test_bucket_for():
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 33, 256)] == [1, 2, 4, 8, 8, 64, 256]
    assert bucket_for(257) is None
    with pytest.raises(GraphDSLError, match="n must be a positive int, got 0"):
        bucket_for(0)


def test_pad_batch_values_and_errors():
    x = {"ids": torch.tensor([7, 8, 9]), "slots": torch.tensor([3, 4, 5]),
         "bt": torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)}
    pads = {"ids": Pad(0), "slots": Pad(-1), "bt": Pad(0, width=4)}
    p = pad_batch(x, pads, 4)
    assert p["ids"].tolist() == [7, 8, 9, 0] and p["slots"].tolist() == [3, 4, 5, -1]
    assert p["bt"].tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0], [0, 0, 0, 0]]
    assert p["bt"].dtype == torch.int32
    with pytest.raises(BindError, match="at most 1 wide"):
        pad_batch(x, {**pads, "bt": Pad(0, width=1)}, 4)
    with pytest.raises(BindError, match="rows must be >= the batch size 3, got 2"):
        pad_batch(x, pads, 2)
    with pytest.raises(BindError, match=r"dim 0 must be the batch size, got \{'ids': 2"):
        pad_batch({**x, "ids": torch.tensor([1, 2])}, pads, 4)
    with pytest.raises(BindError, match=r"missing inputs \['slots'\]"):
        pad_batch({k: v for k, v in x.items() if k != "slots"}, pads, 4)
    runner = CudaGraphRunner(object(), pads)
    assert runner.fits(x) and not runner.fits({**x, "bt": torch.zeros(3, 5, dtype=torch.int32)})
    big = {k: v.repeat(100, *([1] * (v.dim() - 1))) for k, v in x.items()}
    assert not runner.fits(big)                         # 300 rows > the largest bucket
    with pytest.raises(GraphDSLError, match="prologue must be callable or None, got 5"):
        CudaGraphRunner(object(), pads, prologue=5)
    made = []

    class _Engine:          # takes "ids" and the prologue's "twice", not the prologue's own input "slots"
        net = type("Net", (), {"inputs": {"ids": None, "bt": None, "twice": None}})()
    fed = CudaGraphRunner(_Engine(), pads, prologue=lambda s: {"twice": s["slots"] * 2})._feed(x, made)
    assert sorted(fed) == ["bt", "ids", "twice"] and fed["ids"] is x["ids"]
    assert torch.equal(fed["twice"], x["slots"] * 2) and made == [fed["twice"]]


def test_runner_load_equals_fresh_padding_whatever_the_previous_steps():
    """The runner rewrites padding only where an earlier step left values: after any sequence of
    steps (more or fewer rows, wider or narrower tables) its static buffers equal ``pad_batch``."""
    from graphdsl.runtime.serving.cuda_graphs import _Graph
    pads = {"ids": Pad(0), "slots": Pad(-1), "bt": Pad(7, width=6), "cs": Pad(0.0)}
    g = torch.Generator().manual_seed(0)

    def step(n, w):
        return {"ids": torch.randint(1, 9, (n,), generator=g), "slots": torch.randint(0, 50, (n,), generator=g),
                "bt": torch.randint(0, 5, (n, w), generator=g, dtype=torch.int32),
                "cs": torch.rand(n, 3, generator=g)}
    runner = CudaGraphRunner(object(), pads)
    first = step(3, 2)
    entry = _Graph(None, pad_batch(first, pads, 8), {}, [],
                   {k: (3, 2 if k == "bt" else None) for k in pads})
    for n, w in ((5, 6), (2, 1), (8, 3), (1, 4), (1, 4), (6, 2), (4, 6), (3, 5)):
        x = step(n, w)
        runner._load(entry, x, n, pads)
        want = pad_batch(x, pads, 8)
        for k in pads:
            assert torch.equal(entry.inputs[k], want[k]), (n, w, k)


def test_runner_widths_narrow_the_one_fixed_width_input():
    """Graphs of a bucket at narrower widths of its block table: a step takes the narrowest holding
    its table; the static buffers have that width; bad widths are refused by name."""
    pads = {"ids": Pad(0), "bt": Pad(0, width=6)}
    runner = CudaGraphRunner(object(), pads, widths=lambda b: (2, 4) if b == 1 else ())
    assert runner.widths(1) == (2, 4, 6) and runner.widths(2) == (6,)
    assert [runner.width_for(1, w) for w in (1, 2, 3, 5, 6, None)] == [2, 2, 4, 6, 6, 6]
    assert runner.width_for(2, 1) == 6
    with pytest.raises(BindError, match="input 'bt': expected at most 6 columns"):
        runner.width_for(1, 7)
    like = {"ids": ((), torch.int64), "bt": ((6,), torch.int32)}
    static = runner.static_inputs(1, like, "cpu", 4)
    assert static["bt"].shape == (1, 4) and static["ids"].shape == (1,)
    assert runner.static_inputs(1, like, "cpu", 4) is static
    assert runner.static_inputs(1, like, "cpu")["bt"].shape == (1, 6)       # None: the widest
    with pytest.raises(GraphDSLError, match=r"width must be one of \(2, 4, 6\) for bucket 1, got 3"):
        runner.static_inputs(1, like, "cpu", 3)
    with pytest.raises(GraphDSLError, match=r"bucket must be one of .*, got 3"):
        runner.static_inputs(3, like, "cpu")
    assert CudaGraphRunner(object(), pads).widths(1) == (6,)
    assert CudaGraphRunner(object(), {"ids": Pad(0)}).width_for(1) is None
    with pytest.raises(GraphDSLError, match="widths needs a callable and exactly one input with a fixed width"):
        CudaGraphRunner(object(), {"ids": Pad(0)}, widths=lambda b: (1,))
    with pytest.raises(GraphDSLError, match=r"replay: bucket 2 \(width 6\) has no static inputs; call static_inputs"):
        runner.replay(2)
    for bad in ((4, 2), (2, 7), (0, 3), (2.0,)):
        with pytest.raises(GraphDSLError, match=r"widths\(1\) must be ascending ints in \[1, 6\]"):
            CudaGraphRunner(object(), pads, widths=lambda b, bad=bad: bad).widths(1)


def test_env_switch(monkeypatch):
    assert cuda_graphs_enabled(True) and not cuda_graphs_enabled(False)
    monkeypatch.setenv("GRAPHDSL_CUDA_GRAPHS", "0")
    assert not cuda_graphs_enabled(True)


def _decode_step(llm, seq_lens, g):
    bs = llm.block_size
    tables, slots, next_block = [], [], 0
    for L in seq_lens:
        n = -(-L // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
        slots.append(tables[-1][(L - 1) // bs] * bs + (L - 1) % bs)
    width = max(map(len, tables))
    return {"input_ids": torch.randint(0, llm.config.vocab_size, (len(seq_lens),), generator=g),
            "positions": torch.tensor([L - 1 for L in seq_lens]),
            "slot_mapping": torch.tensor(slots),
            "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32)}


@pytest.mark.parametrize("seq_lens", [[5], [5, 17, 30], [3, 9, 16, 2, 40]])
def test_padded_decode_equals_unpadded(seq_lens, tmp_path):
    make_checkpoint("llama", tmp_path)
    llm = gd.LLM(tmp_path, device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8, block_size=8)
    g = torch.Generator().manual_seed(0)
    for c in llm.kv_cache.key_caches + llm.kv_cache.value_caches:
        c.copy_(torch.randn(c.shape, generator=g))
    before = [c.clone() for c in llm.kv_cache.key_caches]
    step = _decode_step(llm, seq_lens, g)
    want = llm.model.execute(Phase.DECODE, step)
    written = [c.clone() for c in llm.kv_cache.key_caches]
    assert any(not torch.equal(a, b) for a, b in zip(before, written))
    for c, b in zip(llm.kv_cache.key_caches, before):
        c.copy_(b)
    width = llm.model._runtime["max_blocks_per_seq"]
    assert width == 8                                    # ceil(max_model_len / block_size)
    bucket = bucket_for(len(seq_lens))
    pads = {k: p for k, p in decode_pads(width).items() if k in step}
    padded = pad_batch(step, pads, bucket)
    assert padded["block_tables"].shape == (bucket, width)
    got = llm.model.execute(Phase.DECODE, padded)
    assert got.shape[0] == bucket and torch.isfinite(got).all()
    torch.testing.assert_close(got[:len(seq_lens)], want, rtol=1e-5, atol=1e-5)
    for c, w, b in zip(llm.kv_cache.key_caches, written, before):
        assert torch.equal(c != b, w != b)               # the same slots written: none by padding rows
        torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-5)
    assert llm.model._graph_runners == {}                # CPU: decode runs eagerly, no graphs


def test_whether_graphs_apply_walks_the_modules_once_per_engine():
    """Every prefill step and every change of a decode batch's rows asks whether the engine's steps
    may be captured; the module walk behind the answer (~0.7 µs a module) is made once per engine."""
    from graphdsl.models.base import _graphs_apply

    class CudaEngine:                 # what _graphs_apply reads of an engine
        device = torch.device("cuda")
        backend = type("Backend", (), {"name": "triton"})()

    llm = gd.LLM.from_config(dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64,
                                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=64), device="cpu", max_model_len=32)
    model, walks = llm.model, []
    walk = model.graph_capturable
    object.__setattr__(model, "graph_capturable", lambda: walks.append(1) or walk())
    first, second = CudaEngine(), CudaEngine()
    assert [_graphs_apply(model, first) for _ in range(3)] == [True] * 3
    assert len(walks) == 1
    assert _graphs_apply(model, second) and len(walks) == 2       # a new engine (rebuilt): asked again
    model._runtime["cuda_graphs"] = False
    assert not _graphs_apply(model, first) and len(walks) == 2    # graphs off: no walk needed
