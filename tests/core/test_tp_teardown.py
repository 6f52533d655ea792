"""Tensor parallelism's teardown and all-reduce switch, without a process group: ``close()`` leaves
the group while the workers leave it, and a teardown that never ends (on two H200s, NCCL's, once decode
graphs had captured collectives) is abandoned with a warning instead of hanging ``close()``;
``GRAPHDSL_ALLREDUCE`` picks the one-shot path by default where the GPUs reach each other (``auto``),
always on request, NCCL on request, and refuses other values; decode graphs are on by default."""
from __future__ import annotations

import importlib.util
import os
import sys
import threading

import pytest

from graphdsl.entrypoints import llm as llm_mod
from graphdsl.entrypoints import tp_driver
from graphdsl.errors import GraphDSLError
from graphdsl.runtime.distributed import collectives


class _Channel:
    def __init__(self, calls):
        self.calls = calls

    def stop(self):
        self.calls.append("stop")


class _Pool:
    def __init__(self, calls):
        self.calls = calls

    def close(self, timeout_s):
        self.calls.append(("join workers", timeout_s))


def _driver(calls, broken=None):
    d = tp_driver.Driver.__new__(tp_driver.Driver)
    d.ctx, d.pool, d.channel = None, _Pool(calls), _Channel(calls)
    d.broken, d.closed = broken, False
    return d


def _recording_leave(monkeypatch, calls, ends=True):
    """``start_leaving`` that records its start; its event is set when ``ends``."""
    import graphdsl.runtime.distributed as distributed
    waits = []

    class Left(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(0.0)

    def start(broken=False):
        calls.append("start leaving" + (" a broken group" if broken else ""))
        left = Left()
        if ends:
            left.set()
        return left
    monkeypatch.setattr(distributed, "start_leaving", start)
    return waits


def test_close_leaves_the_group_while_the_workers_leave_it(monkeypatch, recwarn):
    """Rank 0 starts leaving before it waits for the workers to exit: NCCL's teardown waits for the
    peers, so leaving only after they had exited deadlocked until they were killed (two H200s)."""
    calls = []
    waits = _recording_leave(monkeypatch, calls)
    d = _driver(calls)
    d.close()
    d.close()                                       # a second close does nothing
    assert calls == ["stop", "start leaving", ("join workers", 10.0)]
    assert waits == [tp_driver.LEAVE_GROUP_S] and not [w for w in recwarn if w.category is RuntimeWarning]


def test_close_of_a_broken_group_does_not_announce_and_waits_less(monkeypatch):
    calls = []
    waits = _recording_leave(monkeypatch, calls, ends=False)
    with pytest.warns(RuntimeWarning, match="leaving the tensor-parallel process group took over 5s"):
        _driver(calls, broken=RuntimeError("worker died")).close()
    assert calls == ["start leaving a broken group", ("join workers", 0.1)] and waits == [tp_driver.LEAVE_BROKEN_GROUP_S]


class _Event:
    """A step's CUDA event that ends after ``polls`` queries (never, for None)."""

    def __init__(self, polls=None):
        self.polls, self.queries = polls, 0

    def query(self):
        self.queries += 1
        return self.polls is not None and self.queries > self.polls

    def synchronize(self):                       # what a blocking wait would do: never return
        raise AssertionError("a blocking wait on a step that never ends hangs rank 0")


def _executor(driver):
    ex = tp_driver.TPExecutor.__new__(tp_driver.TPExecutor)
    ex.driver = driver
    return ex


def test_waiting_for_a_step_gives_up_once_a_worker_dies():
    """A step whose collectives wait for a dead worker never ends (NCCL's only at its 600 s timeout):
    rank 0 stops waiting for it as soon as the watch thread has marked the group broken."""
    import time
    from graphdsl.runtime.distributed import WorkerError
    calls = []
    driver = _driver(calls)
    timer = threading.Timer(0.05, lambda: setattr(driver, "broken", WorkerError("worker rank 1 died (killed by signal 9)")))
    start = time.monotonic()
    timer.start()
    with pytest.raises(GraphDSLError, match=r"its tokens are dropped: worker rank 1 died \(killed by signal 9\)"):
        _executor(driver).wait_step(_Event())
    assert time.monotonic() - start < 5.0


def test_waiting_for_a_step_that_ends_returns():
    event = _Event(polls=3)
    _executor(_driver([])).wait_step(event)
    assert event.queries == 4


def test_a_step_that_failed_is_raised_not_the_drain_of_the_step_in_flight(monkeypatch):
    """When a step fails (a worker died), the step still in flight can never end: its drain's own
    error must not replace the one that says why."""
    import torch
    from graphdsl.runtime.distributed import WorkerError
    drained = []

    class Loop:
        def __init__(self, *a, **kw):
            pass

        def has_work(self):
            return True

        def step(self):
            raise WorkerError("worker rank 1 died (killed by signal 9)")

        def drain(self):
            drained.append(True)
            raise GraphDSLError("LLM: a tensor-parallel step failed, its tokens are dropped: ...")

    monkeypatch.setattr(llm_mod, "ServingLoop", Loop)
    llm = llm_mod.LLM.__new__(llm_mod.LLM)
    llm.tokenizer, llm._executor, llm.overlap, llm.device = None, None, True, torch.device("cpu")
    llm.num_preemptions = llm.num_steps = 0
    monkeypatch.setattr(llm, "_scheduler", lambda: type("S", (), {"num_preemptions": 0})(), raising=False)
    Loop.num_steps = 0
    with pytest.raises(WorkerError, match="worker rank 1 died"):
        list(llm._run([]))
    assert drained == [True]


def test_score_waits_for_its_step_as_the_loop_does(monkeypatch):
    """``score`` of a tensor-parallel LLM waits through the executor too: a blocking
    ``torch.cuda.synchronize`` would hold rank 0 while a dead worker's collective never ends."""
    import torch

    import graphdsl as gd
    from tests.helpers.soak import TINY_LLAMA
    llm = gd.LLM.from_config(TINY_LLAMA, device="cpu", max_model_len=64, max_num_seqs=2)
    recorded = []

    class Event:
        def record(self):
            recorded.append(self)

    class Logits:
        is_cuda, device = True, torch.device("cpu")     # the device guard takes the host as a no-op

    class Executor:
        def execute(self, phase, inputs, rows=None):
            return Logits()

        def wait_step(self, event):
            assert recorded == [event]
            raise GraphDSLError("LLM: a tensor-parallel step failed, its tokens are dropped: worker rank 1 died")

        def verify_step(self):
            raise AssertionError("the wait raises first")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a blocking wait"))
    llm._executor = Executor()
    free = llm.blocks.num_free_blocks
    with pytest.raises(GraphDSLError, match="worker rank 1 died"):
        llm.score([3, 1, 4, 1, 5])
    assert llm.blocks.num_free_blocks == free                  # its KV blocks went back


def test_a_teardown_that_never_ends_is_abandoned_with_a_warning(monkeypatch):
    import torch.distributed as dist
    from graphdsl.runtime.distributed import start_leaving
    release = threading.Event()
    entered = threading.Event()

    def stuck():
        entered.set()
        release.wait(30)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", stuck)
    collectives._PEER_BUFFERS[("dev", "dtype", "0")] = object()
    try:
        with pytest.warns(RuntimeWarning, match="leaving the tensor-parallel process group took over"):
            tp_driver.wait_left(start_leaving(), wait_s=0.2)
        assert entered.is_set()
        assert not collectives._PEER_BUFFERS          # the one-shot buffers of the old group are dropped
    finally:
        release.set()


def test_a_teardown_that_ends_returns_without_a_warning(monkeypatch, recwarn):
    import torch.distributed as dist
    from graphdsl.runtime.distributed import start_leaving
    left = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: left.append(True))
    tp_driver.wait_left(start_leaving(), wait_s=5.0)
    assert left == [True] and not [w for w in recwarn if w.category is RuntimeWarning]


def test_without_a_group_leaving_is_done_at_once(monkeypatch):
    import torch.distributed as dist
    from graphdsl.runtime.distributed import start_leaving
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert start_leaving().is_set()


def test_allreduce_path_switch(monkeypatch):
    monkeypatch.delenv("GRAPHDSL_ALLREDUCE", raising=False)
    monkeypatch.delenv("GRAPHDSL_ONESHOT_MAX_BYTES", raising=False)
    monkeypatch.setattr(collectives, "_peers_reachable", lambda: True)
    assert collectives._one_shot_limit() == 512 * 1024          # auto by default: the GPUs reach each other
    monkeypatch.setattr(collectives, "_peers_reachable", lambda: False)
    assert collectives._one_shot_limit() == 0                   # auto, without peer access: NCCL
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "auto")
    assert collectives._one_shot_limit() == 0                   # auto, without peer access: NCCL
    monkeypatch.setattr(collectives, "_peers_reachable", lambda: True)
    assert collectives._one_shot_limit() == 512 * 1024          # auto, every GPU reaches the others
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "nccl")
    assert collectives._one_shot_limit() == 0
    monkeypatch.setattr(collectives, "_peers_reachable", lambda: False)
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "Symm_Mem")
    assert collectives._one_shot_limit() == 512 * 1024          # asked for: taken without the check
    monkeypatch.setenv("GRAPHDSL_ONESHOT_MAX_BYTES", "4096")
    assert collectives._one_shot_limit() == 4096
    monkeypatch.setenv("GRAPHDSL_ALLREDUCE", "multimem")
    with pytest.raises(GraphDSLError, match=r"GRAPHDSL_ALLREDUCE must be 'auto', 'symm_mem' or 'nccl', got 'multimem'"):
        collectives._one_shot_limit()


def test_peers_are_not_reachable_without_a_group_or_off_this_host(monkeypatch):
    import torch
    import torch.distributed as dist
    assert not collectives._peers_reachable()                    # no process group here
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(collectives, "_all_peer_access", lambda world: True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert collectives._peers_reachable()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")                  # torchrun over two hosts
    assert not collectives._peers_reachable()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)   # more ranks than GPUs here
    assert not collectives._peers_reachable()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(collectives, "_all_peer_access", lambda world: False)   # no P2P between them
    assert not collectives._peers_reachable()


def _tp_bench():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, path)
    try:
        spec = importlib.util.spec_from_file_location("tp_bench", os.path.join(path, "tp.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(path)


def test_tp_bench_names_where_greedy_tokens_part():
    same = _tp_bench()._same_tokens
    assert same([1, 2, 3], [1, 2, 3]) == "yes (3)"
    assert same([1, 9, 3], [1, 2, 3]) == "no: from token 1 of 3"
    assert same([1, 2], [1, 2, 3]) == "no: from token 2 of 3"
    assert same([1, 2, 3], None) == "—"
    assert same([1, 9, 3], [1, 2, 3], [2.0, 0.01, 1.0]) == \
        "no: from token 1 of 3 (TP1's top two 0.0100 apart there; 0% of TP1's tokens had them closer)"
    assert same([1, 2, 9], [1, 2, 3], [0.5, 0.1, 1.0]).endswith("67% of TP1's tokens had them closer)")


def test_in_fresh_process_runs_apart_with_its_env_and_reports_failures():
    """The GPU tests' isolation helper: another process, the env given, a failure's traceback."""
    from tests.helpers.tp_ranks import in_fresh_process
    pid, value = in_fresh_process(_pid_and_env, "GRAPHDSL_TEST_PROBE_VALUE", env={"GRAPHDSL_TEST_PROBE_VALUE": "7"})
    assert pid != os.getpid() and value == "7" and "GRAPHDSL_TEST_PROBE_VALUE" not in os.environ
    with pytest.raises(AssertionError, match=r"(?s)_pid_and_env failed in its process.*KeyError"):
        in_fresh_process(_pid_and_env, None)


def _pid_and_env(name):
    return os.getpid(), os.environ[name] if name is not None else {}[name]


def _llm_recording(calls):
    """An LLM whose model and group only record what teardown asks of them."""
    class Model:
        def release_graphs(self):
            calls.append("release graphs")

    class Driver:
        closed = False
        broken = None

        def close(self):
            calls.append("leave group")
            self.closed = True

    llm = llm_mod.LLM.__new__(llm_mod.LLM)
    llm.model, llm._tp = Model(), Driver()
    return llm


def test_close_drops_the_graphs_before_leaving_the_group():
    """NCCL's teardown waits until every graph that captured the communicator is destroyed, so the
    LLM drops its captured graphs before its group goes (once)."""
    calls = []
    llm = _llm_recording(calls)
    llm.close()
    llm.close()
    assert calls == ["release graphs", "leave group", "leave group"]   # the driver's own close is idempotent


def test_a_broken_group_leaves_without_waiting_for_its_graphs():
    """Dropping the graphs synchronizes the device, and after a worker's death its last step may
    hold an NCCL collective that waits for the dead rank for good: close() leaves the group at once."""
    calls = []
    llm = _llm_recording(calls)
    llm._tp.broken = RuntimeError("worker rank 1 died")
    llm.close()
    assert calls == ["leave group"]


def test_an_llm_dropped_without_close_also_drops_its_graphs_first():
    import gc
    calls = []
    llm = _llm_recording(calls)
    tp_driver.close_at_exit(llm)
    del llm
    gc.collect()
    assert calls == ["release graphs", "leave group"]


def test_release_graphs_empties_both_runner_tables():
    import torch
    from tests.models.hf_tiny import make_config
    from graphdsl.models.config import build_config
    from graphdsl.models.registry import resolve_model_class
    config = build_config(make_config("llama").to_dict())
    model = resolve_model_class(config.model_type, config.architectures)(config, torch.float32)
    model._graph_runners[1], model._prefill_runners[2] = object(), object()
    model.release_graphs()
    assert model._graph_runners == {} and model._prefill_runners == {}
    model.release_graphs()                                             # nothing to drop: a no-op


def test_tp_decode_graphs_are_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("GRAPHDSL_TP_CUDA_GRAPHS", raising=False)
    assert tp_driver.tp_cuda_graphs_enabled()
    monkeypatch.setenv("GRAPHDSL_TP_CUDA_GRAPHS", "0")
    assert not tp_driver.tp_cuda_graphs_enabled()
    monkeypatch.setenv("GRAPHDSL_TP_CUDA_GRAPHS", "1")
    assert tp_driver.tp_cuda_graphs_enabled()


class _StuckLeaver:
    """A worker's follower (CPU, no model) whose process cannot leave the group: its teardown's
    event never fires, as when NCCL's teardown waits for a peer that is gone."""

    device = __import__("torch").device("cpu")

    def run_step(self, phase, inputs):
        pass

    def replay_graph(self, rows, width, load):
        pass

    def close(self):
        import graphdsl.runtime.distributed.workers as workers
        workers.start_leaving = threading.Event         # never set
        workers._LEAVE_S = 0.2


def _stuck_leaver(rank, world_size, *, agree):
    return _StuckLeaver()


def test_a_worker_that_cannot_leave_the_group_exits_failing_and_says_why():
    import torch
    from graphdsl.runtime.distributed import StepChannel, WorkerPool, start_leaving
    pool = WorkerPool(2, _stuck_leaver)
    try:
        ctx = pool.join(torch.device("cpu"), timeout_s=60)
        StepChannel(ctx).stop()
        left = start_leaving()
        pool.close(timeout_s=30)
        assert left.wait(30)
    finally:
        pool.close(timeout_s=1)
    assert pool.procs[0].exitcode == 3
    assert "worker rank 1 failed: leaving the process group took over 0s" in pool._why(1, 3)


class _Proc:
    def __init__(self):
        self.exitcode = None


class _WatchedPool:
    def __init__(self):
        self.procs = [_Proc()]

    def check(self):
        from graphdsl.runtime.distributed import WorkerError
        if self.procs[0].exitcode is not None:
            raise WorkerError("tensor-parallel worker rank 1 died (killed by signal 9)")


def _watched_driver(monkeypatch):
    import torch
    released = []
    monkeypatch.setattr(collectives, "release_waiters", lambda: released.append("released"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    d = tp_driver.Driver.__new__(tp_driver.Driver)
    d.ctx, d.pool, d.channel, d.broken, d.closed = None, _WatchedPool(), None, None, False
    return d, released


def test_a_worker_dying_mid_step_releases_rank_0s_waiting_all_reduces(monkeypatch):
    """With the one-shot all-reduce a dead worker's flags never come: rank 0's kernel would spin
    for good. The watch marks the group broken, releases the waiting kernels once, and the loop then
    drops the step's tokens and raises the worker's death."""
    d, released = _watched_driver(monkeypatch)
    watch = threading.Thread(target=d._watch, args=(0.01,))
    watch.start()
    d.pool.procs[0].exitcode = -9
    watch.join(5)
    assert not watch.is_alive() and released == ["released"]
    assert "worker rank 1 died" in str(d.broken)
    ex = tp_driver.TPExecutor.__new__(tp_driver.TPExecutor)
    ex.driver = d
    with pytest.raises(GraphDSLError, match=r"tensor-parallel step failed, its tokens are dropped: .*rank 1 died"):
        ex.verify_step()


def test_a_closing_group_is_not_watched(monkeypatch):
    d, released = _watched_driver(monkeypatch)
    d.closed = True                       # close() marks it closed before the workers exit
    d.pool.procs[0].exitcode = 0
    d._watch(0.01)
    assert released == [] and d.broken is None


def test_the_serving_loop_verifies_a_step_before_reading_its_tokens():
    from graphdsl.runtime.serving.kv_cache import BlockManager
    from graphdsl.runtime.serving.loop import ServingLoop
    from graphdsl.runtime.serving.sampling import SamplingParams
    from graphdsl.runtime.serving.scheduler import Scheduler
    from tests.helpers.fake_model import FakeModel

    class _Failing(FakeModel):
        def verify_step(self):
            raise GraphDSLError("a worker died")
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    loop = ServingLoop(_Failing(blocks, 32), sched, overlap=False)
    req = sched.add_request(0, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(GraphDSLError, match="a worker died"):
        loop.step()
    assert req.output_ids == []


def _loading_forever(rank, world_size, *, agree):
    import time
    while True:                                   # a shard that takes long to load
        time.sleep(1)


def _rank0_then_killed(pids):
    """Rank 0's process: start a worker, say its pid, then wait (the test kills it with SIGKILL)."""
    import time
    from graphdsl.runtime.distributed import WorkerPool
    pool = WorkerPool(2, _loading_forever)
    pids.put(pool.procs[0].pid)
    time.sleep(600)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_worker_exits_when_rank_0s_process_is_killed():
    """multiprocessing ends daemon workers only when rank 0 exits cleanly; a rank 0 killed (or
    crashed) must not leave a worker holding its GPU memory while it loads or waits for steps."""
    from tests.helpers.tp_ranks import worker_outlives_killed_rank0
    assert not worker_outlives_killed_rank0(_rank0_then_killed, (), ready_s=120, gone_within_s=30)
