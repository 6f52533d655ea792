"""Peer-mapped memory across the ranks of one host, through CUDA IPC handles.

Every rank allocates its buffer with torch; :func:`peer_pointers` exchanges the buffers' IPC
handles over the process group (``all_gather_object``) and opens each peer's in this process, so
a kernel on this rank's GPU can load from and store to every rank's buffer by address (NVLink or
PCIe peer access). This is what the one-shot all-reduce (:mod:`..kernels.allreduce`) pushes its
rows through.

It replaces torch's symmetric memory for that purpose. torch's rendezvous keeps process-wide state
(the group name's store, and more: a fresh group name did not help), so after one tensor-parallel
``LLM`` was closed, rank 0 and the fresh workers of the next one disagreed and the rendezvous never
ended (two H200s). Here the exchange is one collective of the current group with
nothing kept between groups: a group's opened handles are closed when it is released
(:func:`close_all`).

The buffers come from torch's caching allocator; the CUDA driver (``libcuda.so.1``, through
``ctypes``) gives the IPC handle of the allocation holding each (``cuMemGetAddressRange``,
``cuIpcGetMemHandle``: the buffer's offset travels with it) and opens the peers' on this rank's
device (``cuIpcOpenMemHandle``, lazy peer access).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from graphdsl.errors import GraphDSLError

__all__ = ["peer_pointers", "close_all", "IPCUnavailable"]

_LAZY_ENABLE_PEER_ACCESS = 1        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_HANDLE_BYTES = 64                  # CU_IPC_HANDLE_SIZE


class IPCUnavailable(GraphDSLError):
    """This process cannot map the peers' memory (no CUDA driver library, or the driver refused,
    e.g. for memory of torch's expandable segments): the caller falls back to NCCL."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


@functools.lru_cache(maxsize=1)
def _driver():
    """The CUDA driver library's IPC entry points: ``(get_handle, address_range, open, close)``."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise IPCUnavailable(f"the CUDA driver library libcuda.so.1 could not be loaded ({e})") from None
    u64 = ctypes.c_uint64
    get = lib.cuIpcGetMemHandle
    get.argtypes = [ctypes.POINTER(_Handle), u64]
    span = getattr(lib, "cuMemGetAddressRange_v2", None) or lib.cuMemGetAddressRange
    span.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
    open_ = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
    open_.argtypes = [ctypes.POINTER(u64), _Handle, ctypes.c_uint]
    close = lib.cuIpcCloseMemHandle
    close.argtypes = [u64]
    for f in (get, span, open_, close):
        f.restype = ctypes.c_int
    return get, span, open_, close


_OPENED: dict = {}        # (device, handle) -> base address of each peer allocation this process mapped


def _call(what: str, rc: int, device) -> None:
    if rc != 0:
        raise IPCUnavailable(f"{what} failed on {device} (CUresult {rc})")


def _share(t: torch.Tensor) -> tuple[bytes, int]:
    """The IPC handle of the allocation holding ``t`` (from torch's caching allocator: a block of
    one ``cudaMalloc``) and ``t``'s byte offset in it."""
    get, span, _, _ = _driver()
    handle, base, size = _Handle(), ctypes.c_uint64(0), ctypes.c_size_t(0)
    with torch.cuda.device(t.device):
        _call("cuMemGetAddressRange", span(ctypes.byref(base), ctypes.byref(size), t.data_ptr()), t.device)
        _call("cuIpcGetMemHandle", get(ctypes.byref(handle), base.value), t.device)
    return ctypes.string_at(ctypes.addressof(handle), _HANDLE_BYTES), t.data_ptr() - base.value


def _open(handle: bytes, device: torch.device) -> int:
    """Map a peer's allocation into this process on ``device`` (lazy peer access), once per
    handle (two buffers of a peer may share one allocation); its base address."""
    key = (device, handle)
    if key not in _OPENED:
        open_ = _driver()[2]
        ptr, h = ctypes.c_uint64(0), _Handle()
        ctypes.memmove(ctypes.addressof(h), handle, _HANDLE_BYTES)
        with torch.cuda.device(device):
            _call("cuIpcOpenMemHandle", open_(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS), device)
        _OPENED[key] = ptr.value
    return _OPENED[key]


def peer_pointers(t: torch.Tensor, rank: int, world_size: int, *, gather=None, opener=None) -> torch.Tensor:
    """Every rank's address of its own ``t`` (a CUDA tensor each rank allocated alike; int64
    ``[W]`` on ``t``'s device, rank order), this rank's being ``t.data_ptr()`` and the others'
    mapped into this process. A collective of the default group: every rank calls it with its own
    ``t``, and none may write a peer's ``t`` before every rank has returned from it.
    ``gather(list, obj)`` and ``opener(handle, device)`` stand in for ``all_gather_object`` and the
    driver (tests). Raises :class:`IPCUnavailable` on every rank when any rank cannot share or map
    its buffer (the exchange carries each rank's failure, so the ranks decide alike)."""
    import torch.distributed as dist
    gather = gather or dist.all_gather_object
    try:
        mine = ("ok",) + _share(t)
    except IPCUnavailable as e:
        mine = ("error", str(e), 0)
    shared = [None] * world_size
    gather(shared, mine)
    failed = [f"rank {r}: {why}" for r, (status, why, _) in enumerate(shared) if status != "ok"]
    if failed:
        raise IPCUnavailable("; ".join(failed))
    ptrs, error = [], None
    try:
        ptrs = [t.data_ptr() if r == rank else (opener or _open)(handle, t.device) + offset
                for r, (_, handle, offset) in enumerate(shared)]
    except IPCUnavailable as e:
        error = str(e)
    verdicts = [None] * world_size
    gather(verdicts, error)               # one rank that could not map makes every rank give up
    failed = [f"rank {r}: {why}" for r, why in enumerate(verdicts) if why]
    if failed:
        raise IPCUnavailable("; ".join(failed))
    return torch.tensor(ptrs, dtype=torch.int64, device=t.device)


def close_all(unmap: bool = True) -> None:
    """Unmap every peer allocation this process mapped (the group is being released). With
    ``unmap=False`` (a broken group) only forget them: unmapping waits for the device, whose last
    step may hold an NCCL collective waiting for a dead peer until NCCL's timeout (two H200s:
    ``close()`` hung there); those mappings live until the process exits."""
    if not unmap:
        _OPENED.clear()
    if not _OPENED:
        return
    close = _driver()[3]
    while _OPENED:
        (device, _), base = _OPENED.popitem()
        with torch.cuda.device(device):
            close(base)
