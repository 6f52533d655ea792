"""ShapeGraphRunner's bookkeeping, on CPU with a stand-in for the CUDA graph: a shape signature runs
eagerly until it has been seen ``capture_after`` times, is then captured and replays with each
step's inputs copied in; too many rows, taps or CPU tensors run eagerly; at most ``max_graphs``
graphs are kept, least recently replayed dropped first. (The real capture: tests/gpu/test_cuda_graphs.py.)"""
import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.serving.cuda_graphs import ShapeGraphRunner, _Graph


class _Engine:
    """``out = 2 * x + y``, counting its calls."""

    def __init__(self):
        self.calls = 0
        self.arena = 1                      # what Engine.arena_id reports; a test regrows it

    def arena_id(self, device):
        return self.arena

    def forward(self, inputs, outputs=None, taps=None):
        self.calls += 1
        out = 2 * inputs["x"] + inputs["y"]
        if outputs is not None:
            outputs["out"].copy_(out)
            return outputs
        return {"out": out}


class _Replay:
    """Stands in for a captured graph: replaying runs the engine on the static buffers."""

    def __init__(self, engine, static, outputs):
        self.engine, self.static, self.outputs, self.replays = engine, static, outputs, 0

    def replay(self):
        self.replays += 1
        self.engine.forward(self.static, self.outputs)


class _CpuRunner(ShapeGraphRunner):
    def capturable(self, inputs):            # the real one asks for CUDA tensors
        rows = max(x.shape[0] for x in inputs.values())
        return rows <= self.max_rows

    def _capture(self, static, ran=False):
        self.ran_before = getattr(self, "ran_before", []) + [ran]
        outputs = self.engine.forward(static)
        return _Graph(_Replay(self.engine, static, outputs), static, outputs, arena=self._arena(static))


def _step(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 4, generator=g), "y": torch.randn(n, 4, generator=g)}


def test_a_shape_is_captured_on_its_second_step_and_replays_new_inputs_after():
    runner = _CpuRunner(_Engine(), max_rows=8, max_graphs=2)
    assert runner.run(_step(3, 0)) is None                      # first sight: the caller runs it eagerly
    assert not runner.graphs
    for seed in (1, 2, 3):                                      # captured at seed 1, replayed with new values
        step = _step(3, seed)
        got = runner.run(step)["out"]
        torch.testing.assert_close(got, 2 * step["x"] + step["y"])
    (entry,) = runner.graphs.values()
    assert entry.graph.replays == 3
    assert runner.ran_before == [True]          # the capture was told the eager run was its warm-up
    before = entry.outputs["out"].clone()
    got.zero_()                                                 # outputs are copies: the static buffer is intact
    assert torch.equal(entry.outputs["out"], before) and before.abs().sum() > 0


def test_too_many_rows_run_eagerly_and_the_oldest_graph_goes_first():
    runner = _CpuRunner(_Engine(), max_rows=8, max_graphs=2)
    assert runner.run(_step(9, 0)) is None and runner.run(_step(9, 1)) is None and not runner.graphs
    for n in (1, 2, 1, 3):                                      # each shape twice: 1 and 2 captured, 1 replayed
        runner.run(_step(n, n))
        runner.run(_step(n, n + 10))
    assert len(runner.graphs) == 2
    shapes = [dict((k, s) for k, s, _, _ in sig)["x"] for sig in runner.graphs]
    assert shapes == [(1, 4), (3, 4)]                           # 2 was least recently replayed: dropped


def test_a_graph_of_a_regrown_arena_is_captured_again_and_the_old_one_let_go():
    """A larger step regrows the engine's arena; graphs captured on the old one hold it, so the
    next call drops them all (any shape) and a dropped shape is captured afresh when it comes."""
    import weakref
    engine = _Engine()
    runner = _CpuRunner(engine, max_rows=8)
    for n in (2, 2, 3, 3):                                      # shapes 2 and 3 captured on arena 1
        runner.run(_step(n, n))
    old = next(g for g in runner.graphs.values() if g.inputs["x"].shape == (2, 4))
    gone = [weakref.ref(g) for g in runner.graphs.values()]
    runner.run(_step(2, 2))
    assert runner.graphs[next(reversed(runner.graphs))] is old and old.graph.replays == 2
    engine.arena = 2                                            # a larger plan regrew the arena
    runner.run(_step(5, 0))                                     # any call: both old graphs go
    assert not runner.graphs
    step = _step(2, 3)
    torch.testing.assert_close(runner.run(step)["out"], 2 * step["x"] + step["y"])
    (new,) = runner.graphs.values()
    assert new is not old and new.arena == 2 and new.graph.replays == 1
    del old
    assert all(ref() is None for ref in gone)                   # nothing keeps the old graphs (their arena views)
    step = _step(2, 4)
    torch.testing.assert_close(runner.run(step)["out"], 2 * step["x"] + step["y"])
    assert next(iter(runner.graphs.values())) is new and new.graph.replays == 2


def test_a_capture_after_every_graph_was_dropped_takes_a_fresh_memory_pool(monkeypatch):
    """The pool of graphs that are all gone is one the allocator will not capture into again."""
    handles = iter(range(100, 200))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    runner = ShapeGraphRunner(_Engine())
    first = runner._graph_pool()
    runner.graphs[("shape",)] = object()                        # a graph holds the pool: shared
    assert runner._graph_pool() == first
    runner.graphs.clear()                                        # the arena regrew: all dropped
    assert runner._graph_pool() == first + 1


def test_capture_after_zero_captures_on_first_sight_and_bad_settings_are_refused():
    runner = _CpuRunner(_Engine(), capture_after=0)
    step = _step(2, 5)
    torch.testing.assert_close(runner.run(step)["out"], 2 * step["x"] + step["y"])
    assert runner.ran_before == [False]          # never ran eagerly: the capture runs its own warm-up
    for kw, msg in ((dict(max_rows=0), r"max_rows must be an int >= 1, got 0"),
                    (dict(max_graphs="4"), r"max_graphs must be an int >= 1, got '4'"),
                    (dict(capture_after=-1), r"capture_after must be an int >= 0, got -1")):
        with pytest.raises(GraphDSLError, match=msg):
            ShapeGraphRunner(_Engine(), **kw)


def test_the_real_runner_runs_cpu_tensors_and_tapped_steps_eagerly(monkeypatch):
    runner = ShapeGraphRunner(_Engine(), capture_after=0)
    assert runner.run(_step(2, 0)) is None                      # CPU tensors: never captured
    monkeypatch.setenv("GRAPHDSL_TAPS", "out")
    assert not runner.capturable(_step(2, 0))
    assert not runner.graphs and not runner.seen


def test_prefill_graphs_are_on_by_default_and_never_on_cpu(tmp_path, monkeypatch):
    """``GRAPHDSL_PREFILL_GRAPHS`` is on unless set to 0; on, a CPU model still prefills eagerly."""
    import graphdsl as gd
    from graphdsl.models.base import prefill_graphs_enabled
    from tests.models.hf_tiny import make_checkpoint
    monkeypatch.setenv("GRAPHDSL_PREFILL_GRAPHS", "0")
    assert not prefill_graphs_enabled()
    monkeypatch.setenv("GRAPHDSL_PREFILL_GRAPHS", "off")
    assert not prefill_graphs_enabled()
    monkeypatch.delenv("GRAPHDSL_PREFILL_GRAPHS", raising=False)
    assert prefill_graphs_enabled()
    make_checkpoint("llama", tmp_path)
    llm = gd.LLM(tmp_path, device="cpu", dtype="float32", max_model_len=32)
    params = gd.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for _ in range(2):
        llm.generate([[1, 2, 3]], params)
    assert llm.model._prefill_runners == {}


def test_a_shape_whose_capture_fails_runs_eagerly_after_one_warning(caplog):
    class _Failing(_CpuRunner):
        captures = 0

        def _capture(self, static, ran=False):
            self.captures += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    runner = _Failing(_Engine(), capture_after=0)
    with caplog.at_level("WARNING"):
        assert all(runner.run(_step(2, s)) is None for s in range(3))
    assert runner.captures == 1 and not runner.graphs
    (rec,) = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert "'x': [2, 4]" in rec.getMessage() and "stream is capturing" in rec.getMessage()


def test_captures_run_on_a_stream_of_the_captured_device(monkeypatch):
    """One capture stream a device: torch.cuda.graph's own default is one stream of whichever device
    was current first, which put a second GPU's captured kernels on the first GPU (a model split
    over two GPUs gave wrong tokens, then an illegal address; two H200s)."""
    from graphdsl.runtime.serving import cuda_graphs

    class Stream:
        def __init__(self, index):
            self.index = index
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_graphs, "_CAPTURE_STREAMS", {})
    second = cuda_graphs.capture_stream(torch.device("cuda", 1))
    first = cuda_graphs.capture_stream("cuda")
    assert (second.index, first.index) == (1, 0)
    assert cuda_graphs.capture_stream("cuda:1") is second and cuda_graphs.capture_stream("cuda:0") is first


def test_a_capture_neither_waits_for_the_device_nor_empties_the_caches(monkeypatch):
    """torch.cuda.graph synchronises the device and empties torch's device and pinned-host caches
    before every capture; a warm-up captures ~60 graphs, and the steps after each allocated the
    memory (and the pinned read-back buffers) again. ``capturing`` orders the capture stream after
    the current one on the device instead, and still ends a capture that raised."""
    from graphdsl.runtime.serving import cuda_graphs
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    class Graph:
        def capture_begin(self, *pool):
            log.append(("begin",) + pool)

        def capture_end(self):
            log.append(("end",))

    def refuse(what):
        def call(*a, **k):
            raise AssertionError(f"{what} called")
        return call
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, refuse(name))
    monkeypatch.setattr(torch._C, "_host_emptyCache", refuse("_host_emptyCache"), raising=False)
    monkeypatch.setattr(cuda_graphs, "capture_stream", lambda device: Stream("capture"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))

    class StreamCtx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            log.append(("on", self.s.name))

        def __exit__(self, *exc):
            log.append(("off", self.s.name))
    monkeypatch.setattr(torch.cuda, "stream", StreamCtx)
    with cuda_graphs.capturing(Graph(), "pool", torch.device("cuda", 0)):
        log.append(("work",))
    assert log == [("wait", "capture", "current"), ("on", "capture"), ("begin", "pool"), ("work",), ("end",),
                   ("off", "capture")]
    log.clear()
    with pytest.raises(RuntimeError, match="sync inside"):
        with cuda_graphs.capturing(Graph(), None, torch.device("cuda", 0)):
            raise RuntimeError("sync inside the capture")
    assert log == [("wait", "capture", "current"), ("on", "capture"), ("begin",), ("end",), ("off", "capture")]
