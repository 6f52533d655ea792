"""Tensor-parallel decode graphs, without GPUs: rank 0 announces a graph replay as its key and its
static inputs in one packed buffer (:meth:`StepChannel.send_graph`, over gloo here), a worker loads
them into its own graph's buffer and replays it (``tp_driver.Follower``); rank 0's loop-facing
graph announces before it replays (``tp_driver.TPDecodeGraph``). The GPU test replays real graphs
on two GPUs (tests/gpu/test_tensor_parallel_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from graphdsl.entrypoints import tp_driver
from graphdsl.errors import GraphDSLError
from graphdsl.runtime.serving.cuda_graphs import _packed_buffers, packed_inputs

SPECS = {"input_ids": ((4,), torch.int64), "positions": ((4,), torch.int64), "seq_lens": ((4,), torch.int32),
         "block_tables": ((4, 3), torch.int32)}


def _filled(seed: int) -> dict[str, torch.Tensor]:
    bufs = _packed_buffers(SPECS, "cpu")
    g = torch.Generator().manual_seed(seed)
    for t in bufs.values():
        t.copy_(torch.randint(-1000, 1000, t.shape, generator=g))
    return bufs


def test_static_inputs_are_views_of_one_buffer_that_copies_them_all():
    a, b = _filled(1), _filled(2)
    assert any(not torch.equal(a[k], b[k]) for k in SPECS)
    packed_inputs(b).copy_(packed_inputs(a))
    for k in SPECS:
        assert torch.equal(a[k], b[k]) and b[k].dtype == SPECS[k][1]
        assert b[k].data_ptr() % 16 == 0
    with pytest.raises(GraphDSLError, match="not views of one buffer"):
        packed_inputs({"a": torch.zeros(2), "b": torch.zeros(2)})


class _Recorder:
    """A worker's follower that keeps what it was asked to run."""

    def __init__(self):
        self.graphs, self.steps, self.bufs = [], [], _packed_buffers(SPECS, "cpu")

    def replay_graph(self, rows, width, load):
        load(packed_inputs(self.bufs))
        self.graphs.append((rows, width, {k: v.clone() for k, v in self.bufs.items()}))

    def run_step(self, phase, inputs):
        self.steps.append((phase, {k: v.clone() for k, v in inputs.items()}))


def _channel_ranks(rank: int, world: int):
    from graphdsl.runtime.distributed import StepChannel, init_distributed
    ctx = init_distributed(rank, world, torch.device("cpu"))
    channel = StepChannel(ctx)
    sent = [_filled(10), _filled(11)]
    eager = {"input_ids": torch.arange(3), "seq_lens": torch.tensor([5, 6, 7], dtype=torch.int32)}
    if rank == 0:
        channel.send_graph(4, 3, packed_inputs(sent[0]))
        channel.send("decode", eager)
        channel.send_graph(4, 3, packed_inputs(sent[1]))
        channel.stop()
        return None
    follower = _Recorder()
    assert channel.serve(follower) == 3
    assert [(r, w) for r, w, _ in follower.graphs] == [(4, 3), (4, 3)]
    for (_, _, got), want in zip(follower.graphs, sent):
        for k in SPECS:
            assert torch.equal(got[k], want[k]), k
    (phase, inputs), = follower.steps
    assert phase == "decode" and all(torch.equal(inputs[k], eager[k]) for k in eager)
    return None


def test_graph_steps_reach_the_workers_with_rank_0s_inputs():
    from tests.helpers.tp_ranks import run_ranks
    run_ranks(2, _channel_ranks)


def test_a_worker_whose_graph_holds_other_bytes_refuses():
    from graphdsl.runtime.distributed.workers import _receive_packed
    with pytest.raises(GraphDSLError, match="rank 0 sent 96 bytes, this rank's graph holds 112"):
        _receive_packed(96, torch.zeros(112, dtype=torch.uint8))


class _Channel:
    def __init__(self, calls):
        self.calls = calls

    def send_graph(self, rows, width, packed):
        self.calls.append(("announce", rows, width, packed.numel()))


class _Local:
    def __init__(self, calls, rows=4, width=3):
        self.calls, self.rows, self.width = calls, rows, width
        self.inputs = _packed_buffers(SPECS, "cpu")

    def replay(self, n):
        self.calls.append(("replay", n))
        return "logits", "greedy"


def _driver(calls):
    d = tp_driver.Driver.__new__(tp_driver.Driver)
    d.ctx, d.pool, d.channel = None, None, _Channel(calls)
    d.broken, d.closed = None, False
    return d


def test_rank_0s_graph_announces_then_replays_and_a_closed_group_refuses():
    calls = []
    d = _driver(calls)
    graph = tp_driver.TPDecodeGraph(_Local(calls), d)
    assert graph.inputs["block_tables"].shape == (4, 3) and (graph.rows, graph.width) == (4, 3)
    assert graph.replay(2) == ("logits", "greedy")
    assert calls == [("announce", 4, 3, 128), ("replay", 2)]
    d.closed = True
    with pytest.raises(GraphDSLError, match="tensor-parallel group is closed"):
        graph.replay(2)


def test_a_failed_announcement_marks_the_group_broken():
    d = _driver([])

    class Broken:
        def send_graph(self, *a):
            raise RuntimeError("peer gone")
    d.channel = Broken()
    graph = tp_driver.TPDecodeGraph(_Local([]), d)
    with pytest.raises(RuntimeError, match="peer gone"):
        graph.replay(1)
    with pytest.raises(GraphDSLError, match="tensor-parallel group is broken"):
        graph.replay(1)


class _Executor:
    def __init__(self, calls, rows, width):
        self.calls, self.rows, self.width, self.made = calls, rows, width, 0

    def decode_graph(self, n, width=None):
        self.made += 1
        return _Local(self.calls, self.rows, self.width)


def _follower(executor):
    f = tp_driver.Follower.__new__(tp_driver.Follower)
    f.llm = type("L", (), {"_local_executor": executor})()
    f._graphs = {}
    return f


def test_a_worker_loads_rank_0s_inputs_then_replays_its_own_graph_kept_by_key():
    calls = []
    ex = _Executor(calls, 4, 3)
    f = _follower(ex)
    want = _filled(3)
    loads = []

    def load(buf):
        loads.append(buf.numel())
        buf.copy_(packed_inputs(want))
    f.replay_graph(4, 3, load)
    f.replay_graph(4, 3, load)
    assert ex.made == 1 and loads == [128, 128] and calls == [("replay", 4), ("replay", 4)]
    graph, _ = f._graphs[(4, 3)]
    assert all(torch.equal(graph.inputs[k], want[k]) for k in SPECS)


def test_a_worker_without_the_same_graph_says_so():
    f = _follower(_Executor([], 8, 3))
    with pytest.raises(GraphDSLError, match=r"replays the decode graph of 4 rows at width 3, this rank has \(8, 3\)"):
        f.replay_graph(4, 3, lambda buf: None)


def test_without_graphs_rank_0_hands_the_loop_none():
    class NoGraphs:
        device, vocab_size, block_size, max_blocks_per_seq = torch.device("cpu"), 10, 16, 4

        def decode_graph(self, n, width=None):
            return None

        def decode_widths(self, n):
            return ()
    ex = tp_driver.TPExecutor(NoGraphs(), _driver([]))
    assert ex.decode_graph(1) is None and ex.decode_graph(1, lora=True) is None and ex.decode_widths(1) == ()
