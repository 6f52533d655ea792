"""The one-shot all-reduce's buffer exchange (``runtime/distributed/ipc.py``) without GPUs: the
handles travel through a stand-in ``all_gather_object``, the driver's open is a stand-in too. Each
rank gets its own address and the peers' mapped ones plus offsets; a rank that cannot share or map
its buffer makes every rank give up, naming it, and then the group's all-reduces stay on NCCL
(``collectives._peers`` says so once, as a warning)."""
from __future__ import annotations

import pytest
import torch

from graphdsl.runtime.distributed import collectives, ipc


class _Ranks:
    """``all_gather_object`` for one rank of a group whose other ranks' contributions are given:
    each call fills the list with the next round's entries, this rank's own in its place."""

    def __init__(self, rank, rounds):
        self.rank, self.rounds, self.sent = rank, list(rounds), []

    def __call__(self, out, obj):
        self.sent.append(obj)
        entries = list(self.rounds.pop(0))
        entries[self.rank] = obj
        out[:] = entries


def _opened():
    calls = []

    def opener(handle, device):
        calls.append(handle)
        return {b"A" * 64: 1 << 40, b"C" * 64: 2 << 40}[handle]
    return opener, calls


def test_each_rank_gets_its_own_address_and_the_peers_mapped_ones(monkeypatch):
    t = torch.zeros(8)
    monkeypatch.setattr(ipc, "_share", lambda x: (b"B" * 64, 256))
    opener, calls = _opened()
    gather = _Ranks(1, [[("ok", b"A" * 64, 512), None, ("ok", b"C" * 64, 0)], [None, None, None]])
    ptrs = ipc.peer_pointers(t, 1, 3, gather=gather, opener=opener)
    assert ptrs.tolist() == [(1 << 40) + 512, t.data_ptr(), 2 << 40]
    assert calls == [b"A" * 64, b"C" * 64]              # only the peers' handles are opened
    assert gather.sent == [("ok", b"B" * 64, 256), None]


def test_a_rank_that_cannot_share_makes_every_rank_give_up(monkeypatch):
    monkeypatch.setattr(ipc, "_share", lambda x: (b"B" * 64, 0))
    opener, calls = _opened()
    gather = _Ranks(0, [[None, ("error", "cuIpcGetMemHandle failed on cuda:1 (CUresult 1)", 0)]])
    with pytest.raises(ipc.IPCUnavailable, match=r"rank 1: cuIpcGetMemHandle failed"):
        ipc.peer_pointers(torch.zeros(4), 0, 2, gather=gather, opener=opener)
    assert calls == []


def test_a_rank_that_cannot_map_makes_every_rank_give_up(monkeypatch):
    """Rank 0 mapped its peer's buffer; rank 1 could not map rank 0's: both must leave the
    one-shot path, or rank 0 would wait for flags rank 1 never raises."""
    monkeypatch.setattr(ipc, "_share", lambda x: (b"B" * 64, 0))
    opener, _ = _opened()
    gather = _Ranks(0, [[None, ("ok", b"A" * 64, 0)], [None, "cuIpcOpenMemHandle failed on cuda:1 (CUresult 201)"]])
    with pytest.raises(ipc.IPCUnavailable, match=r"rank 1: cuIpcOpenMemHandle failed"):
        ipc.peer_pointers(torch.zeros(4), 0, 2, gather=gather, opener=opener)


def test_without_the_driver_sharing_is_refused_not_crashed(monkeypatch):
    def missing():
        raise ipc.IPCUnavailable("the CUDA driver library libcuda.so.1 could not be loaded (test)")
    monkeypatch.setattr(ipc, "_driver", missing)
    gather = _Ranks(0, [[None, ("ok", b"A" * 64, 0)]])
    with pytest.raises(ipc.IPCUnavailable, match=r"rank 0: the CUDA driver library"):
        ipc.peer_pointers(torch.zeros(4), 0, 2, gather=gather)
    assert gather.sent[0][0] == "error"                  # the failure travelled to the peers


class _Dist:
    class group:
        class WORLD:
            group_name = "0"

    @staticmethod
    def get_world_size():
        return 2

    @staticmethod
    def get_rank():
        return 0


def test_the_group_falls_back_to_nccl_once_when_buffers_cannot_be_mapped(monkeypatch):
    calls = []

    def refuse(t, rank, world):
        calls.append(t.numel())
        raise ipc.IPCUnavailable("rank 1: cuIpcOpenMemHandle failed on cuda:1 (CUresult 201)")
    monkeypatch.setattr(ipc, "peer_pointers", refuse)
    monkeypatch.setattr(collectives, "_PEER_BUFFERS", {})
    with pytest.warns(UserWarning, match=r"stay on NCCL: rank 1: cuIpcOpenMemHandle"):
        assert collectives._peers(_Dist, torch.device("cpu"), torch.bfloat16, 1024) is None
    assert collectives._peers(_Dist, torch.device("cpu"), torch.bfloat16, 1024) is None    # decided once
    assert len(calls) == 1


def test_release_unmaps_what_was_opened(monkeypatch):
    closed = []
    monkeypatch.setattr(ipc, "_driver", lambda: (None, None, None, closed.append))
    monkeypatch.setattr(ipc, "_OPENED", {})
    monkeypatch.setattr(torch.cuda, "device", lambda d: _NoDevice())
    ipc._OPENED[("cuda:0", b"A" * 64)] = 1 << 40
    ipc._OPENED[("cuda:0", b"C" * 64)] = 2 << 40
    collectives.release_collective_buffers()
    assert sorted(closed) == [1 << 40, 2 << 40] and ipc._OPENED == {}


def test_a_broken_group_forgets_its_mappings_without_unmapping(monkeypatch):
    """Unmapping waits for the device, whose last step may hold an NCCL collective waiting for the
    dead peer (two H200s: close() hung there): a broken group's mappings are only forgotten."""
    closed = []
    monkeypatch.setattr(ipc, "_driver", lambda: (None, None, None, closed.append))
    monkeypatch.setattr(ipc, "_OPENED", {("cuda:0", b"A" * 64): 1 << 40})
    monkeypatch.setattr(torch.cuda, "device", lambda d: _NoDevice())
    collectives.release_collective_buffers(unmap=False)
    assert closed == [] and ipc._OPENED == {}


class _NoDevice:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_carry_buffers_are_mapped_once_or_refused_once(monkeypatch):
    """The carried all-reduce's buffers (runtime/backends/tp_carry.py) take the same exchange: mapped
    once per group and row width, with a data buffer of two slots of W regions of MAX_ROWS rows and a
    zeroed int64 counter; a rank that cannot map makes every rank run the sites as before, said once."""
    from graphdsl.runtime.backends.tp_carry import MAX_ROWS
    sent = []

    def share(t, rank, world):
        sent.append((t.dtype, t.numel(), int(t.abs().sum())))
        return torch.tensor([t.data_ptr()] * world, dtype=torch.int64)
    monkeypatch.setattr(ipc, "peer_pointers", share)
    monkeypatch.setattr(collectives, "_dist", lambda world_size: _Dist)
    monkeypatch.setattr(collectives, "_CARRY_BUFFERS", {})
    bufs = collectives.carry_buffers(2, torch.device("cpu"), torch.bfloat16, 64)
    assert collectives.carry_buffers(2, torch.device("cpu"), torch.bfloat16, 64) is bufs
    assert sent == [(torch.bfloat16, 2 * 2 * MAX_ROWS * 64, 0), (torch.int64, 2, 0)]
    assert (bufs.rank, bufs.world_size, bufs.region) == (0, 2, MAX_ROWS * 64) and bufs.calls.tolist() == [0, 0]
    assert bufs.rows_fit(MAX_ROWS, 64) and not bufs.rows_fit(MAX_ROWS + 1, 64)

    def refuse(t, rank, world):
        sent.append("refused")
        raise ipc.IPCUnavailable("rank 1: cuIpcOpenMemHandle failed on cuda:1 (CUresult 201)")
    monkeypatch.setattr(ipc, "peer_pointers", refuse)
    with pytest.warns(UserWarning, match=r"carried all-reduce unavailable, TP sites run as before: rank 1"):
        assert collectives.carry_buffers(2, torch.device("cpu"), torch.bfloat16, 128) is None
    assert collectives.carry_buffers(2, torch.device("cpu"), torch.bfloat16, 128) is None     # decided once
    assert sent[2:] == ["refused"]
    collectives.release_collective_buffers()
    assert collectives._CARRY_BUFFERS == {}


def test_a_dead_peer_releases_both_kinds_of_waiters(monkeypatch):
    """``release_waiters`` raises the one-shot flags past any call (2⁶³ − 1: they are stored, not added
    to) and the carried GEMVs' counters far past any call's columns (2⁶², so the live peers' adds
    still fit in 64 bits)."""
    from graphdsl.runtime.kernels.allreduce import local_peers
    from graphdsl.runtime.kernels.tp_carry import local_carry_buffers
    raised = []
    monkeypatch.setattr(collectives, "_raise_from_side", lambda t, value: raised.append((t, value)))
    peers = local_peers(2, 64, torch.bfloat16, "cpu")[0]
    flags = torch.zeros(8, dtype=torch.int64)
    peers._keep = (None, flags)                  # as _peers keeps them: this rank's data and flags
    bufs = local_carry_buffers(2, 64, torch.bfloat16, "cpu")[0]
    monkeypatch.setattr(collectives, "_PEER_BUFFERS", {"a": peers, "b": None})
    monkeypatch.setattr(collectives, "_CARRY_BUFFERS", {"c": bufs, "d": None})
    collectives.release_waiters()
    assert [(t.data_ptr(), v) for t, v in raised] == [(flags.data_ptr(), 2 ** 63 - 1),
                                                      (bufs.counter.data_ptr(), 2 ** 62)]
