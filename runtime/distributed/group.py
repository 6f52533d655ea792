"""Process groups for tensor parallelism.

One process per rank. The default ``torch.distributed`` group carries the model's collectives (the
graph's ``all_reduce``/``all_gather`` nodes): NCCL when the ranks run on CUDA, gloo on CPU. A second
gloo group carries small host messages (the step headers rank 0 sends to workers), so those never
touch the GPU stream.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from graphdsl.env import env_number
from graphdsl.errors import GraphDSLError

__all__ = ["DistContext", "backend_for", "init_distributed", "launched_by_torchrun", "torchrun_env", "start_leaving"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistContext:
    """This process's place: ``rank`` of ``world_size``, its ``device``, and the host-message group."""

    rank: int
    world_size: int
    device: torch.device
    control: object = None           # gloo ProcessGroup for headers (None at world size 1)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def agree_min(self, key: str, value: int) -> int:
        """The least ``value`` over the ranks, over the host group (gloo, CPU tensors): the group's
        form of :class:`~.workers.WorkerPool`'s ``agree`` (``key`` names the quantity, unused here)."""
        import torch.distributed as dist
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (its environment variables are set)."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def torchrun_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError) as e:
        raise GraphDSLError(f"torchrun environment incomplete or malformed ({e}); launch with "
                            f"`torchrun --nproc-per-node N ...`") from None


def dist_timeout_s() -> float:
    """Seconds a collective or a rendezvous may wait for the other ranks: ``GRAPHDSL_DIST_TIMEOUT_S``,
    default 600."""
    return env_number("GRAPHDSL_DIST_TIMEOUT_S", 600.0, minimum=1.0)


def init_distributed(rank: int, world_size: int, device: torch.device, *, store=None,
                     timeout_s: float | None = None) -> DistContext:
    """Join (or reuse) the default process group as ``rank`` of ``world_size`` on ``device``.

    ``store``: a ``torch.distributed.Store`` to rendezvous through (default: torchrun's ``env://``).
    On CUDA the device becomes the current one and the group is NCCL; on CPU, gloo. ``timeout_s``
    bounds every collective (default ``GRAPHDSL_DIST_TIMEOUT_S`` or 600 s), so a lost rank ends in
    an error instead of a hang.
    """
    import torch.distributed as dist
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s or dist_timeout_s())
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise GraphDSLError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                                f"{dist.get_world_size()}, not rank {rank} of {world_size}")
    else:
        kw = {"store": store} if store is not None else {"init_method": "env://"}
        dist.init_process_group(backend_for(device), rank=rank, world_size=world_size, timeout=timeout, **kw)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend_for(device) != "gloo" else dist.group.WORLD
    return DistContext(rank, world_size, device, control)


def start_leaving(broken: bool = False):
    """Start leaving the default process group, in a thread, and return a ``threading.Event`` set
    once it is left (at once when there is no group). The group's one-shot all-reduce buffers are
    dropped and the peers' unmapped first (a later group exchanges its own); a ``broken`` group's
    are not unmapped, which would wait for a device that may be stuck on the dead rank.

    Every rank must be leaving at the same time: NCCL's teardown of a communicator waits for its
    peers, so a rank that first waited for the others to exit, and left only then, deadlocked with
    them (on two H200s the workers were killed after their 10 s). The caller bounds the wait; a
    teardown that needs a dead or stuck rank is left to the process's exit."""
    import threading

    import torch.distributed as dist

    from .collectives import release_collective_buffers
    done = threading.Event()
    if not dist.is_initialized():
        done.set()
        return done
    release_collective_buffers(unmap=not broken)

    def leave():
        try:
            dist.destroy_process_group()
        finally:
            done.set()
    threading.Thread(target=leave, name="graphdsl-tp-leave", daemon=True).start()
    return done
