"""graphdsl.runtime.distributed — tensor parallelism's runtime: process groups (NCCL on GPU, gloo
on CPU), collective lowerings onto the engine's buffers, and the step channel that lets rank 0
drive worker ranks (spawned by ``LLM(tensor_parallel_size=N)`` or started by ``torchrun``)."""
from .collectives import release_collective_buffers
from .group import DistContext, backend_for, init_distributed, launched_by_torchrun, start_leaving, torchrun_env
from .workers import StepChannel, WorkerError, WorkerPool

__all__ = ["DistContext", "backend_for", "init_distributed", "launched_by_torchrun", "torchrun_env", "start_leaving",
           "StepChannel", "WorkerError", "WorkerPool", "release_collective_buffers"]
