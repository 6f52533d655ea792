"""Lowerings of the collective graph ops onto the engine's planned buffers (``dst``), for the
triton backend: ``all_reduce`` reduces in place in its output slot, ``all_gather`` gathers straight
into it when the gathered dim is the leading one, ``reduce_scatter`` scatters into it. On CUDA these
are NCCL calls on the current stream; the torch references (:mod:`graphdsl.functional.collective`)
stay the semantics and the CPU path.

Small CUDA all-reduces take the one-shot path instead (``GRAPHDSL_ALLREDUCE``: ``auto``, the
default, where every rank's GPU is on this host and reaches the others' memory; ``symm_mem``
always; ``nccl`` never): every rank pushes its rows into buffers mapped into every rank's process
(CUDA IPC handles, :mod:`.ipc`) and sums what the others pushed, in one Triton launch with one
flag exchange (:mod:`..kernels.allreduce`); no NVLink multicast involved. When the all-reduce's
only reader is the ``add_rms_norm`` right after it (a tensor-parallel layer's o or down
projection), the same launch adds the residual and normalises (:func:`norm_after`,
:func:`all_reduce_add_rms_norm`), and the norm launches nothing. Messages above
``GRAPHDSL_ONESHOT_MAX_BYTES`` (default 512 KiB), other dtypes, rows of another width than the
group's first one-shot call, and groups whose ranks cannot map each other's buffers stay on NCCL
(every rank decides alike: the ranks' calls have the same shapes in the same order, and the
buffer exchange carries each rank's failure).

On two H200s the Llama-3-8B shape's TP2 decode takes 2.588 ms a token this way against 2.975 with
NCCL (docs/distributed.md; torch's ``one_shot_all_reduce_copy_out``, which this replaced, 2.868).
"""
from __future__ import annotations

import functools
import os

import torch

from graphdsl.env import env_number
from graphdsl.errors import GraphDSLError

__all__ = ["COLLECTIVE_LOWERINGS", "release_collective_buffers", "release_waiters", "norm_after",
           "all_reduce_add_rms_norm", "carry_buffers", "carry_takes"]


def _dist(world_size: int):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise GraphDSLError("collectives with world_size > 1 need torch.distributed initialised (launch with torchrun "
                            "or LLM(tensor_parallel_size=N))")
    return dist


_PEER_BUFFERS: dict = {}          # (device, dtype, group name) -> the group's PeerBuffers (None: NCCL)
_CARRY_BUFFERS: dict = {}         # (device, dtype, group name, width) -> the group's CarryBuffers (None: not mapped)


def release_collective_buffers(unmap: bool = True) -> None:
    """Drop the one-shot buffers of the current group and unmap the peers' (before the group is
    destroyed: a later group exchanges its own); a broken group's are only forgotten
    (:func:`~graphdsl.runtime.distributed.ipc.close_all`)."""
    from .ipc import close_all
    _PEER_BUFFERS.clear()
    _CARRY_BUFFERS.clear()
    close_all(unmap)


def release_waiters() -> None:
    """Let every one-shot all-reduce and carried GEMV of this process that waits for a peer go on (a
    peer died, so its flags or columns will never come): this rank's flags and counters are raised
    far past any call's, from a stream of their own, so the kernel spinning on them ends. Its sums
    are then garbage; the caller has marked the group broken, and the step's results are dropped
    (``TPExecutor.verify_step`` in ``graphdsl.entrypoints.tp_driver``)."""
    for peers in list(_PEER_BUFFERS.values()):
        if peers is None:
            continue
        _raise_from_side(peers._keep[1], 2 ** 63 - 1)
    for bufs in list(_CARRY_BUFFERS.values()):
        if bufs is not None:            # counted with adds: leave the live peers' adds room
            _raise_from_side(bufs.counter, 2 ** 62)


def _raise_from_side(t: torch.Tensor, value: int) -> None:
    """``t.fill_(value)`` from a stream of its own, waited for (the step's stream is stuck)."""
    side = torch.cuda.Stream(t.device)
    with torch.cuda.stream(side):
        t.fill_(value)
    side.synchronize()


def _one_shot_limit() -> int:
    """Bytes up to which all-reduces take the one-shot path (0: never). ``GRAPHDSL_ALLREDUCE``:
    ``auto`` (default) when every rank runs on a GPU of this host that can reach the others'
    memory (:func:`_peers_reachable`); ``symm_mem`` always; ``nccl`` never."""
    mode = os.environ.get("GRAPHDSL_ALLREDUCE", "auto").strip().lower()
    if mode not in ("auto", "symm_mem", "nccl"):
        raise GraphDSLError(f"GRAPHDSL_ALLREDUCE must be 'auto', 'symm_mem' or 'nccl', got {mode!r}")
    if mode == "nccl" or (mode == "auto" and not _peers_reachable()):
        return 0
    return int(env_number("GRAPHDSL_ONESHOT_MAX_BYTES", 512 * 1024, integer=True))


def _peers_reachable() -> bool:
    """Whether the default group's ranks all run on this host, rank ``r`` on GPU ``r`` as
    ``LLM(tensor_parallel_size=N)`` and a one-host ``torchrun`` place them, with every GPU able to
    read and write the others' memory (peer access: NVLink, or PCIe P2P)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized() and torch.cuda.is_available()):
        return False
    world = dist.get_world_size()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if (local is not None and int(local) != world) or world > torch.cuda.device_count():
        return False
    return _all_peer_access(world)


@functools.lru_cache(maxsize=None)
def _all_peer_access(world: int) -> bool:
    """Whether each of GPUs ``0..world-1`` can access every other's memory (asked once a process)."""
    return all(torch.cuda.can_device_access_peer(i, j) for i in range(world) for j in range(world) if i != j)


def _peers(dist, device: torch.device, dtype: torch.dtype, limit: int):
    """The group's :class:`~..kernels.allreduce.PeerBuffers` for ``dtype`` on ``device``, made and
    exchanged on first use (every rank reaches its first all-reduce together, so the exchange, a
    collective, lines up): a data buffer of two slots of ``W`` regions of ``limit`` bytes, and an
    int64 flag array zeroed before the exchange (so no rank's first flag can land before a peer
    has cleared its array), each rank's mapped into every rank (:mod:`.ipc`). None, on every
    rank, when some rank cannot map the others' memory: then the group's all-reduces stay on NCCL
    (said once, as a warning)."""
    from ..kernels.allreduce import MAX_ROWS, PeerBuffers
    group = dist.group.WORLD.group_name
    key = (device, dtype, group)
    if key in _PEER_BUFFERS:
        return _PEER_BUFFERS[key]
    world, rank = dist.get_world_size(), dist.get_rank()
    region = limit // torch.empty((), dtype=dtype).element_size()
    data = torch.empty(2 * world * region, dtype=dtype, device=device)
    flags = torch.zeros(world * MAX_ROWS, dtype=torch.int64, device=device)
    ptrs = _map_everywhere((data, flags), rank, world, "one-shot all-reduce unavailable, all-reduces stay on NCCL")
    if ptrs is None:
        _PEER_BUFFERS[key] = None
        return None
    peers = PeerBuffers(ptrs[0], ptrs[1], torch.zeros(MAX_ROWS, dtype=torch.int64, device=device), rank, world,
                        region, dtype)
    peers._keep = (data, flags)
    _PEER_BUFFERS[key] = peers
    return peers


def _map_everywhere(tensors, rank: int, world: int, unavailable: str):
    """Each of ``tensors`` (this rank's, just made) mapped into every rank: a list of int64 ``[W]``
    pointer tensors (:func:`.ipc.peer_pointers`, a collective), or None on every rank when some
    rank cannot share or map (said once, as a warning starting with ``unavailable``)."""
    from .ipc import IPCUnavailable, peer_pointers
    device = tensors[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)      # zeroed before any peer can write
    try:
        return [peer_pointers(t, rank, world) for t in tensors]
    except IPCUnavailable as e:
        import warnings
        warnings.warn(f"{unavailable}: {e}", stacklevel=3)
        return None


def carry_takes(t: torch.Tensor) -> bool:
    """Whether an all-reduce of ``t`` (a TP site's rows) may be carried by the GEMVs around it
    (:mod:`..backends.tp_carry`): where and as the one-shot path would take it."""
    return _one_shot_ok(t)


def carry_buffers(world_size: int, device: torch.device, dtype: torch.dtype, width: int):
    """The group's :class:`~..kernels.tp_carry.CarryBuffers` for rows of ``width`` (up to
    ``tp_carry.MAX_ROWS`` of them a call), made and exchanged on first use like :func:`_peers`'
    (every rank reaches its first carried site together): a data buffer of two slots of ``W``
    regions and an int64 counter zeroed before the exchange. None, on every rank, when some rank
    cannot map the others' memory (the sites then run as before)."""
    from ..backends.tp_carry import MAX_ROWS
    from ..kernels.tp_carry import CarryBuffers
    dist = _dist(world_size)
    key = (device, dtype, dist.group.WORLD.group_name, width)
    if key in _CARRY_BUFFERS:
        return _CARRY_BUFFERS[key]
    world, rank = dist.get_world_size(), dist.get_rank()
    region = MAX_ROWS * width
    data = torch.zeros(2 * world * region, dtype=dtype, device=device)
    counter = torch.zeros(2, dtype=torch.int64, device=device)
    ptrs = _map_everywhere((data, counter), rank, world, "carried all-reduce unavailable, TP sites run as before")
    if ptrs is None:
        _CARRY_BUFFERS[key] = None
        return None
    bufs = CarryBuffers(ptrs[0], ptrs[1], data, counter, torch.zeros(2, dtype=torch.int64, device=device), rank,
                        world, region)
    _CARRY_BUFFERS[key] = bufs
    return bufs


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, last dim]`` (a view), or None when its rows are not evenly strided."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return t.view(1, -1)
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _flat_rows(t: torch.Tensor, width: int | None = None) -> torch.Tensor | None:
    """``t``'s elements as rows of ``width`` for a sum that does not care about rows (a group's
    one-shot buffers keep one row width): contiguous ``t`` in rows of ``width``, or ``t``'s own rows
    when they are that wide; None otherwise. ``width`` None (the group's first call): ``t``'s own
    rows when one program holds one, else rows of 4096."""
    from ..kernels.allreduce import MAX_WIDTH
    rows = _rows(t)
    if width is None:
        width = rows.shape[1] if rows is not None and rows.shape[1] <= MAX_WIDTH else 4096
    if t.is_contiguous() and t.numel() % width == 0:
        return t.view(-1, width)
    return rows if rows is not None and rows.shape[1] == width else None


def _device_ok(x: torch.Tensor) -> bool:
    """The one-shot path runs on CUDA tensors (peer-mapped memory)."""
    return x.is_cuda


def _one_shot_ok(x: torch.Tensor, *others: torch.Tensor, rows=_rows) -> bool:
    """Whether the one-shot path takes ``x`` (and ``others`` of its shape and dtype) as ``rows``
    gives them."""
    from ..kernels.allreduce import MAX_ROWS, MAX_WIDTH
    limit = _one_shot_limit()
    if not (limit and _device_ok(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.numel() * x.element_size() <= limit):
        return False
    r = rows(x)
    return (r is not None and r.shape[0] <= MAX_ROWS and r.shape[1] <= MAX_WIDTH
            and all(o.shape == x.shape and o.dtype == x.dtype and rows(o) is not None
                    and rows(o).shape == r.shape for o in others))


def _all_reduce(be, node, ins, attrs, dsts):
    x, dst = ins[0], dsts[0]
    if attrs.get("world_size", 1) == 1:
        return [dst.copy_(x) if dst is not None else x.clone()]
    if dst is None:
        dst = torch.empty_like(x)
    if _one_shot_ok(x, dst, rows=_flat_rows):
        from ..kernels.allreduce import MAX_ROWS, one_shot_all_reduce
        peers = _peers(_dist(attrs["world_size"]), x.device, x.dtype, _one_shot_limit())
        xr, dr = (None, None) if peers is None else (_flat_rows(x, peers.width), _flat_rows(dst, peers.width))
        if xr is not None and dr is not None and xr.shape == dr.shape and xr.shape[0] <= MAX_ROWS:
            one_shot_all_reduce(xr, peers, dr)
            return [dst]
    if dst.data_ptr() != x.data_ptr():
        dst.copy_(x)
    _dist(attrs["world_size"]).all_reduce(dst)
    return [dst]


def norm_after(nodes) -> dict:
    """``{all_reduce node: (add_rms_norm node, index of the norm's input it feeds)}`` for each
    all-reduce of ``nodes`` (a run's node list) that the next node normalises and nothing else
    reads: the pairs :func:`all_reduce_add_rms_norm` may run as one launch."""
    if not nodes:
        return {}
    from ..backends.norm_carry import readers_and_outputs
    readers, outputs = readers_and_outputs(nodes)
    pairs = {}
    for a, b in zip(nodes, nodes[1:]):
        if a.op != "all_reduce" or b.op != "add_rms_norm" or a.attrs.get("world_size", 1) == 1:
            continue
        y = a.outputs[0]
        if readers.get(y) != [b] or y in outputs or b.inputs[0] is b.inputs[1] or y not in b.inputs[:2]:
            continue
        pairs[a] = (b, b.inputs.index(y))
    return pairs


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            out: torch.Tensor, sum_out: torch.Tensor, world_size: int) -> bool:
    """``sum_out = all_reduce(x) + residual``, ``out = rms_norm(sum_out, weight, eps)`` in one
    one-shot launch, when that path takes these tensors; False (nothing done) otherwise. Each
    program reads its row of ``x`` and ``residual`` before it writes that row of the outputs, so an
    output may share an input's memory row for row (the caller checks that it shares no more)."""
    if world_size == 1 or not _one_shot_ok(x, residual, out, sum_out) or weight.dtype != x.dtype \
            or not weight.is_contiguous() or weight.shape != x.shape[-1:]:
        return False
    from ..kernels.allreduce import one_shot_all_reduce
    peers = _peers(_dist(world_size), x.device, x.dtype, _one_shot_limit())
    if peers is None or not peers.takes(x.shape[-1]):
        return False
    one_shot_all_reduce(_rows(x), peers, _rows(out), residual=_rows(residual), weight=weight,
                        sum_out=_rows(sum_out), eps=eps)
    return True


def _all_gather(be, node, ins, attrs, dsts):
    x, dst, w = ins[0], dsts[0], attrs.get("world_size", 1)
    if w == 1:
        return [dst.copy_(x)]
    dim = attrs.get("dim", 0) % x.dim()
    dist = _dist(w)
    if dim == 0 and dst.is_contiguous():
        dist.all_gather_into_tensor(dst, x.contiguous())
        return [dst]
    stacked = torch.empty((w,) + tuple(x.shape), dtype=x.dtype, device=x.device)   # [W, ..., n, ...]
    dist.all_gather_into_tensor(stacked, x.contiguous())
    dst.copy_(stacked.movedim(0, dim).reshape(dst.shape))
    return [dst]


def _reduce_scatter(be, node, ins, attrs, dsts):
    x, dst, w = ins[0], dsts[0], attrs.get("world_size", 1)
    if w == 1:
        return [dst.copy_(x)]
    dim = attrs.get("dim", 0) % x.dim()
    src = x.movedim(dim, 0).contiguous() if dim else x.contiguous()
    out = dst if dim == 0 and dst.is_contiguous() else torch.empty_like(src[: src.shape[0] // w])
    _dist(w).reduce_scatter_tensor(out, src)
    if out is not dst:
        dst.copy_(out.movedim(0, dim))
    return [dst]


COLLECTIVE_LOWERINGS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter}
