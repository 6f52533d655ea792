"""Rank 0 drives, workers follow: the step channel, and the worker processes ``LLM`` owns.

:class:`StepChannel` — every model step rank 0 runs is announced to the other ranks first: a small
header (the phase and the inputs' names, shapes and dtypes) over the host (gloo) group, then the
input tensors themselves, packed into one flat tensor per dtype, by ``broadcast`` over the default
group (NCCL on GPU: no host copy). A decode step that replays CUDA graphs is announced shorter
(:meth:`StepChannel.send_graph`): the graph's bucket and width, then rank 0's static inputs of that
graph in one broadcast straight into the workers' (a header and one broadcast a step; the graphs'
collectives were captured on every rank alike).
Workers run :meth:`StepChannel.serve`: receive a step, run it on their shard (its collectives meet
rank 0's), repeat, until rank 0 sends ``stop``. Only rank 0 samples, so every rank runs the same
steps whatever the sampling settings.

:class:`WorkerPool` — ranks ``1..N-1`` as spawned processes that rendezvous through a ``TCPStore``
rank 0 hosts. Each worker builds its shard, then marks itself ready in the store; rank 0 waits for
every mark while watching the processes, so a worker that fails while loading surfaces as a
:class:`WorkerError` naming its rank and error instead of a hang; the process group forms only
after that. During serving, a step whose collectives fail (a peer died) is re-raised the same way.
"""
from __future__ import annotations

import functools
import math
import multiprocessing as mp
import os
import socket
import time
import traceback
from typing import Callable

import torch

from graphdsl.errors import GraphDSLError

from .group import DistContext, dist_timeout_s, init_distributed, start_leaving

__all__ = ["StepChannel", "WorkerPool", "WorkerError"]


class WorkerError(GraphDSLError):
    """A tensor-parallel worker process failed or died; the message names its rank."""


class StepChannel:
    """Announce steps from rank 0 (:meth:`send`, :meth:`stop`); follow them elsewhere (:meth:`serve`)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx

    def _bcast_header(self, header):
        import torch.distributed as dist
        box = [header]
        dist.broadcast_object_list(box, src=0, group=self.ctx.control)
        return box[0]

    def send(self, phase: str, inputs: dict[str, torch.Tensor]) -> None:
        """Rank 0: tell the workers to run ``phase`` on ``inputs`` (device tensors). The inputs
        travel packed, one flat broadcast per dtype (a step's are a few small integer tensors)."""
        import torch.distributed as dist
        names = sorted(inputs)
        self._bcast_header(("step", phase, [(n, tuple(inputs[n].shape), inputs[n].dtype) for n in names]))
        for dtype, group in _by_dtype(names, inputs).items():
            flat = torch.cat([inputs[n].reshape(-1).to(self.ctx.device) for n in group])
            dist.broadcast(flat, src=0)

    def send_graph(self, rows: int, width: int, packed: torch.Tensor) -> None:
        """Rank 0: tell the workers to replay their decode CUDA graph of ``rows`` rows at block-table
        ``width`` over ``packed``, rank 0's static inputs of that graph (one byte buffer, see
        :func:`~graphdsl.runtime.serving.cuda_graphs.packed_inputs`), broadcast into theirs: one
        header and one broadcast a step, however many inputs the graph has."""
        import torch.distributed as dist
        self._bcast_header(("graph", rows, width, packed.numel()))
        dist.broadcast(packed, src=0)

    def stop(self) -> None:
        """Rank 0: end the workers' :meth:`serve` loops."""
        self._bcast_header(("stop",))

    def serve(self, follower) -> int:
        """Workers: follow rank 0's steps until ``stop``; returns the steps run. ``follower`` runs
        them: ``follower.run_step(phase, inputs)`` for a step sent with :meth:`send`, and
        ``follower.replay_graph(rows, width, load)`` for one sent with :meth:`send_graph`, where
        ``load(buffer)`` fills the graph's packed static inputs with rank 0's."""
        import torch.distributed as dist
        steps = 0
        while True:
            header = self._bcast_header(None)
            if header[0] == "stop":
                return steps
            if header[0] == "graph":
                _, rows, width, nbytes = header
                follower.replay_graph(rows, width, functools.partial(_receive_packed, nbytes))
                steps += 1
                continue
            _, phase, specs = header
            shapes = {name: (shape, dtype) for name, shape, dtype in specs}
            inputs = {}
            for dtype, group in _by_dtype(sorted(shapes), shapes).items():
                sizes = [math.prod(shapes[n][0]) for n in group]
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.ctx.device)
                dist.broadcast(flat, src=0)
                for n, part in zip(group, flat.split(sizes)):
                    inputs[n] = part.view(shapes[n][0])
            follower.run_step(phase, inputs)
            steps += 1


def _receive_packed(nbytes: int, buffer: torch.Tensor) -> None:
    """A worker's side of :meth:`StepChannel.send_graph`: rank 0's packed inputs into ``buffer``."""
    import torch.distributed as dist
    if buffer.numel() != nbytes:       # the ranks' graphs differ: a bug, not a user error
        raise GraphDSLError(f"decode graph inputs: rank 0 sent {nbytes} bytes, this rank's graph holds "
                            f"{buffer.numel()}")
    dist.broadcast(buffer, src=0)


def _by_dtype(names: list[str], specs: dict) -> dict:
    """``{dtype: [names]}`` in ``names`` order; ``specs[n]`` is a tensor or a ``(shape, dtype)``."""
    out: dict = {}
    for n in names:
        spec = specs[n]
        out.setdefault(spec.dtype if isinstance(spec, torch.Tensor) else spec[1], []).append(n)
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agree_min(store, rank: int, world_size: int, key: str, value: int, *, timeout_s: float,
              check: Callable[[], None] | None = None) -> int:
    """The least ``value`` over the ranks, through ``store`` (before the process group exists):
    each rank sets ``{key}/{rank}``, then waits for every rank's, calling ``check`` (which raises
    for a dead peer) while it waits."""
    store.set(f"{key}/{rank}", str(int(value)))
    keys = [f"{key}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise WorkerError(f"tensor-parallel ranks did not agree on {key!r} within {timeout_s:.0f}s: {missing}")
        time.sleep(0.01)
    return min(int(store.get(k)) for k in keys)


_LEAVE_S = 30.0      # a worker's wait for the group's teardown, as rank 0's (LLM.close)
_ORPHAN_EXIT = 4     # a worker's exit code once rank 0's process is gone


def exit_with_parent(parent_pid: int, every_s: float = 0.5) -> None:
    """Start a thread that ends this process (exit code 4) once ``parent_pid`` is no longer its
    parent: rank 0's process was killed or crashed without closing its ``LLM``. A daemon worker
    outlives such a parent (multiprocessing ends daemons only at a clean exit), and would otherwise
    hold its GPU memory while it waits for rank 0 until ``GRAPHDSL_DIST_TIMEOUT_S``, or for good
    while it is still loading. Polls ``os.getppid()``; ``prctl(PR_SET_PDEATHSIG)`` would instead
    fire when the spawning *thread* ends (an LLM may be built in a thread that then returns)."""
    import threading

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(_ORPHAN_EXIT)
    threading.Thread(target=watch, name="graphdsl-tp-parent-watch", daemon=True).start()


def _worker_main(rank: int, world_size: int, port: int, build: Callable, build_args: tuple, errors,
                 parent_pid: int) -> None:
    """A worker process: build the shard, mark ready, join the group, serve steps, leave cleanly;
    exit at once if rank 0's process goes (:func:`exit_with_parent`)."""
    import torch.distributed as dist
    exit_with_parent(parent_pid)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        agree = functools.partial(_agree_as_worker, store, rank, world_size)
        follower = build(rank, world_size, *build_args, agree=agree)          # loads this rank's weights
        store.set(f"ready/{rank}", "1")
        ctx = init_distributed(rank, world_size, follower.device, store=dist.PrefixStore("pg", store))
        StepChannel(ctx).serve(follower)
        if hasattr(follower, "close"):
            follower.close()
        if not start_leaving().wait(_LEAVE_S):        # rank 0 leaves at the same time
            _exit_reporting(errors, (rank, f"leaving the process group took over {_LEAVE_S:.0f}s", ""), 3)
    except BaseException as e:   # reported to rank 0 with the traceback, then a failing exit code
        _exit_reporting(errors, (rank, f"{type(e).__name__}: {e}", traceback.format_exc()), 1)


def _exit_reporting(errors, report: tuple, code: int) -> None:
    """Put ``report`` on the error queue, wait until it has left this process (``os._exit`` would
    otherwise drop what the queue's feeder thread has not sent yet), then exit with ``code``."""
    errors.put(report)
    errors.close()
    errors.join_thread()
    os._exit(code)


def _agree_as_worker(store, rank: int, world_size: int, key: str, value: int) -> int:
    return agree_min(store, rank, world_size, key, value, timeout_s=dist_timeout_s())


class WorkerPool:
    """Ranks ``1..world_size-1`` as processes started with ``spawn``.

    ``build(rank, world_size, *build_args, agree=fn)`` runs in each worker and returns its follower:
    an object with ``device``, what :meth:`StepChannel.serve` calls (``run_step`` and
    ``replay_graph``), and optionally ``close()``, called when serving ends, before the worker
    leaves the process group. ``agree(key, value)`` returns the least
    ``value`` over the ranks (each calls it with the same ``key``; rank 0 through :meth:`agree`): how
    ranks that size something from their own free memory settle on one size before the group forms.
    The caller (rank 0) builds its own shard, then calls :meth:`join` to wait for the workers and
    form the process group. A worker whose rank-0 process is gone exits by itself (exit code 4).
    """

    def __init__(self, world_size: int, build: Callable, build_args: tuple = ()):
        import torch.distributed as dist
        if world_size < 2:
            raise GraphDSLError(f"WorkerPool: world_size must be >= 2, got {world_size}")
        self.world_size = world_size
        self.port = _free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, world_size, is_master=True, wait_for_workers=False)
        spawn = mp.get_context("spawn")
        self.errors = spawn.Queue()
        self.procs = [spawn.Process(target=_worker_main, name=f"graphdsl-tp-rank{r}", daemon=True,
                                    args=(r, world_size, self.port, build, build_args, self.errors, os.getpid()))
                      for r in range(1, world_size)]
        for p in self.procs:
            p.start()
        self.closed = False

    def join(self, device: torch.device, *, timeout_s: float = 600.0) -> DistContext:
        """Wait until every worker has loaded its shard (raising :class:`WorkerError` for one that
        fails or exits first), then form the process group as rank 0."""
        import torch.distributed as dist
        keys = [f"ready/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                waiting = [k for k in keys if not self.store.check([k])]
                raise WorkerError(f"tensor-parallel workers not ready after {timeout_s:.0f}s: {waiting}")
            time.sleep(0.05)
        return init_distributed(0, self.world_size, device, store=dist.PrefixStore("pg", self.store))

    def agree(self, key: str, value: int) -> int:
        """Rank 0's side of the workers' ``agree``: the least ``value`` over the ranks (a worker that
        fails meanwhile is raised as :class:`WorkerError`)."""
        return agree_min(self.store, 0, self.world_size, key, value, timeout_s=dist_timeout_s(), check=self.check)

    def check(self) -> None:
        """Raise :class:`WorkerError` naming the first worker that failed or exited."""
        for r, p in enumerate(self.procs, 1):
            if p.exitcode is not None and not (self.closed and p.exitcode == 0):
                raise WorkerError(self._why(r, p.exitcode))

    def failure(self) -> WorkerError | None:
        """A :class:`WorkerError` for a dead worker, waiting briefly for a dying one, else None."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check()
            except WorkerError as e:
                return e
            time.sleep(0.05)
        return None

    def _why(self, rank: int, code: int) -> str:
        reports = {}
        while True:
            try:
                r, msg, tb = self.errors.get_nowait()
            except Exception:
                break
            reports[r] = (msg, tb)
        if rank in reports:
            msg, tb = reports[rank]
            return f"tensor-parallel worker rank {rank} failed: {msg}\n{tb}"
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"tensor-parallel worker rank {rank} died ({how})"

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait for workers to exit (after the channel's ``stop``), killing any that do not."""
        self.closed = True
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(1.0)
