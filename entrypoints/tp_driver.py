"""Tensor parallelism as :class:`~graphdsl.entrypoints.llm.LLM` drives it: rank 0 announces every
step to the worker ranks and then runs its own shard; the workers follow.

- :class:`Driver` — rank 0's side: the step channel, the worker pool it owns (None under
  torchrun), a watch that marks the group broken when a worker dies, and the group's teardown.
- :class:`TPExecutor` — rank 0's step executor for the serving loop: each step announced, then run
  here; :class:`TPDecodeGraph` the same for a replayed decode CUDA graph.
- :class:`Follower` — a worker rank's shard, running the steps rank 0 announces.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphdsl.env import env_flag
from graphdsl.errors import GraphDSLError

if TYPE_CHECKING:
    from graphdsl.models.base import FlashCausalLM
    from graphdsl.models.executor import ModelExecutor

    from .llm import LLM

__all__ = ["Driver", "TPExecutor", "TPDecodeGraph", "Follower", "tp_cuda_graphs_enabled", "close_group",
           "close_at_exit", "wait_left", "LEAVE_GROUP_S", "LEAVE_BROKEN_GROUP_S"]


class Driver:
    """Rank 0's side: the step channel, the worker pool it owns (None under torchrun), and state."""

    def __init__(self, ctx, pool):
        from graphdsl.runtime.distributed import StepChannel
        self.ctx, self.pool, self.channel = ctx, pool, StepChannel(ctx)
        self.broken: BaseException | None = None
        self.closed = False
        if pool is not None:
            import threading
            threading.Thread(target=self._watch, name="graphdsl-tp-watch", daemon=True).start()

    def _watch(self, every_s: float = 0.2) -> None:
        """While the group is open, look at the workers every ``every_s``: when one has died, mark
        the group broken and release this rank's one-shot all-reduces and carried GEMVs waiting for
        it (:func:`~graphdsl.runtime.distributed.collectives.release_waiters`), so a step in flight
        ends and the worker's death is raised (:meth:`TPExecutor.verify_step`) instead of rank 0
        spinning on a flag that never comes. (NCCL's collectives end on their own timeout.)"""
        import time

        from graphdsl.runtime.distributed import WorkerError
        while not self.closed:
            time.sleep(every_s)
            if self.closed:
                return
            try:
                self.pool.check()
            except WorkerError as e:
                self._break(self.broken or e)
                return

    def _break(self, e: BaseException) -> None:
        """Mark the group broken by ``e``, and release this rank's one-shot all-reduces and carried
        GEMVs that may be waiting for a peer that will not come (their sums are dropped with the step)."""
        self.broken = e
        if torch.cuda.is_available():
            from graphdsl.runtime.distributed.collectives import release_waiters
            release_waiters()

    def announced(self, announce, run):
        """``announce(channel)`` to the workers, then ``run()`` here; a failure (a worker died, a
        collective broke) marks the group broken and is raised as its cause."""
        if self.closed or self.broken is not None:
            raise GraphDSLError(f"LLM: the tensor-parallel group is {'closed' if self.closed else 'broken'} "
                                f"({self.broken or 'close() was called'}); make a new LLM")
        try:
            if self.pool is not None:
                self.pool.check()
            announce(self.channel)
            return run()
        except Exception as e:
            raise self.failed(e) from e

    def failed(self, e: BaseException) -> BaseException:
        """The error to raise for ``e`` from a step: a worker's death when that is the cause."""
        if self.pool is not None:
            why = self.pool.failure()
            if why is not None:
                self._break(why)
                return why
        self._break(e)
        return e

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.broken is None:
                self.channel.stop()              # the workers start leaving the group on it
        finally:
            if self.pool is not None:            # the group is ours (not torchrun's): leave it with them
                from graphdsl.runtime.distributed import start_leaving
                left = start_leaving(broken=self.broken is not None)
                self.pool.close(timeout_s=10.0 if self.broken is None else 0.1)
                wait_left(left, LEAVE_GROUP_S if self.broken is None else LEAVE_BROKEN_GROUP_S)


def tp_cuda_graphs_enabled() -> bool:
    """Whether tensor-parallel ranks replay decode CUDA graphs, their collectives captured: yes
    unless ``GRAPHDSL_TP_CUDA_GRAPHS=0`` (eager decode steps, each announced with its inputs)."""
    return env_flag("GRAPHDSL_TP_CUDA_GRAPHS", True)


def close_group(model: FlashCausalLM, tp: Driver) -> None:
    """Drop ``model``'s CUDA graphs, then close the group (once): NCCL's teardown waits for every
    graph that captured the communicator to be destroyed. A broken group keeps its graphs: dropping
    them waits for the device, whose last step may hold an NCCL collective waiting for the dead
    rank until NCCL's own timeout (on two H200s ``close()`` hung there for minutes); that group's
    teardown is left to the process's exit anyway (:data:`LEAVE_BROKEN_GROUP_S`)."""
    if not tp.closed and tp.broken is None:
        model.release_graphs()
    tp.close()


def close_at_exit(llm: "LLM") -> None:
    """Close ``llm``'s tensor-parallel group when it is garbage-collected or at interpreter exit."""
    import weakref
    weakref.finalize(llm, close_group, llm.model, llm._tp)


# How long close() waits for the process group's teardown, and when a rank died. On two H200s,
# once decode graphs (GRAPHDSL_TP_CUDA_GRAPHS=1) had captured NCCL collectives, the teardown never
# returned until the ranks dropped their graphs first (LLM.close and Follower.close); and while
# rank 0 waited for its workers to exit before leaving itself, the workers' teardown waited for it,
# until they were killed (start_leaving: every rank leaves at once).
LEAVE_GROUP_S = 30.0
LEAVE_BROKEN_GROUP_S = 5.0


def wait_left(left, wait_s: float) -> None:
    """Wait at most ``wait_s`` seconds for the group's teardown (``left``, from ``start_leaving``):
    one that needs a dead or stuck rank is left to the process's exit, with a warning, instead of
    hanging ``close()``."""
    if not left.wait(wait_s):
        import warnings
        warnings.warn(f"LLM.close: leaving the tensor-parallel process group took over {wait_s:.0f}s; "
                      "left to the process's exit", RuntimeWarning, stacklevel=3)


class TPExecutor:
    """Rank 0's step executor: announces each step to the workers, then runs its own shard. With
    decode CUDA graphs (the default; ``GRAPHDSL_TP_CUDA_GRAPHS=0`` turns them off) it hands the
    serving loop rank 0's decode graph (:class:`TPDecodeGraph`), so a steady decode step is one
    announcement and one replay on every rank, as at one rank; otherwise each step's inputs travel
    whole and run eagerly."""

    def __init__(self, local: ModelExecutor, driver: Driver):
        self.local, self.driver = local, driver
        self.device, self.vocab_size = local.device, local.vocab_size
        self.block_size, self.max_blocks_per_seq = local.block_size, local.max_blocks_per_seq

    def execute(self, phase: str, inputs: dict[str, torch.Tensor], rows: int | None = None) -> torch.Tensor:
        return self.driver.announced(lambda ch: ch.send(phase, inputs),
                                     lambda: self.local.execute(phase, inputs, rows))

    def decode_graph(self, n: int, lora: bool = False, width: int | None = None):
        """Rank 0's decode graph for ``n`` rows (as :meth:`ModelExecutor.decode_graph`), or None
        (graphs off; LoRA does not run under tensor parallelism)."""
        local = None if lora else self.local.decode_graph(n, width=width)
        return None if local is None else TPDecodeGraph(local, self.driver)

    def decode_widths(self, n: int) -> tuple[int, ...]:
        return self.local.decode_widths(n)

    def verify_step(self) -> None:
        """Raise when a worker died while the steps whose tokens just reached the host ran: their
        all-reduces may have been released without the worker's part (:meth:`Driver._watch`)."""
        if self.driver.broken is not None:
            raise GraphDSLError(f"LLM: a tensor-parallel step failed, its tokens are dropped: {self.driver.broken}")

    def wait_step(self, event) -> None:
        """Wait for a step's CUDA ``event`` as ``event.synchronize()`` does, but raise (as
        :meth:`verify_step`) once the group is broken: a step whose NCCL collectives wait for a dead
        worker ends only at NCCL's timeout (``GRAPHDSL_DIST_TIMEOUT_S``, 600 s), so a blocking wait
        would hold rank 0 there; on two H200s it did, in the serving loop's drain after the step
        that found the worker dead had raised. Polls the event, yielding the GIL between polls to
        the watch thread that marks the group broken (:meth:`Driver._watch`)."""
        import time
        while not event.query():
            self.verify_step()
            time.sleep(0)


class TPDecodeGraph:
    """Rank 0's decode graph of one bucket and width, as the serving loop's ``DecodeGraph``: each
    replay first sends the workers the graph's key and rank 0's static inputs (the loop wrote them:
    new rows, grown block tables, sampled tokens), then replays here; each worker replays its own
    graph of the same key over those inputs (:meth:`Follower.replay_graph`)."""

    def __init__(self, local, driver: Driver):
        from graphdsl.runtime.serving.cuda_graphs import packed_inputs
        self.local, self.driver = local, driver
        self.rows, self.width, self.inputs = local.rows, local.width, local.inputs
        self._packed = packed_inputs(self.inputs)

    def replay(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.driver.announced(lambda ch: ch.send_graph(self.rows, self.width, self._packed),
                                     lambda: self.local.replay(n))


class Follower:
    """A worker rank's shard: runs the steps rank 0 announces (``StepChannel.serve``)."""

    def __init__(self, llm: "LLM"):
        self.llm, self.device = llm, llm.device
        self._graphs: dict[tuple[int, int], object] = {}

    def run_step(self, phase: str, inputs: dict[str, torch.Tensor]):
        return self.llm._local_executor.execute(phase, inputs)

    def replay_graph(self, rows: int, width: int, load) -> None:
        """Replay this rank's decode graph of ``rows`` rows at ``width`` after ``load(buffer)`` has
        filled its packed static inputs with rank 0's."""
        from graphdsl.runtime.serving.cuda_graphs import packed_inputs
        entry = self._graphs.get((rows, width))
        if entry is None:
            graph = self.llm._local_executor.decode_graph(rows, width=width)
            if graph is None or (graph.rows, graph.width) != (rows, width):
                got = None if graph is None else (graph.rows, graph.width)
                raise GraphDSLError(f"tensor-parallel worker: rank 0 replays the decode graph of {rows} rows at "
                                    f"width {width}, this rank has {got} (the ranks' graph settings differ)")
            entry = self._graphs[(rows, width)] = (graph, packed_inputs(graph.inputs))
        graph, packed = entry
        load(packed)
        graph.replay(rows)

    def close(self) -> None:
        """Serving ended: drop the shard's CUDA graphs before the worker leaves the group."""
        self._graphs.clear()
        self.llm.model.release_graphs()
