"""Process groups formed one after another in one process take names no earlier group had, and the
ranks of one group agree on them (``runtime/distributed/group.py``). torch names the default group
"0" again after a teardown, while its symmetric memory keeps a name's rendezvous store for the life
of the process: a second tensor-parallel ``LLM`` with the one-shot all-reduce then rendezvoused over
the first group's store and hung (two H200s, session 38)."""
from __future__ import annotations

import torch

from tests.helpers.tp_ranks import in_fresh_process, run_ranks


def _two_groups_one_after_the_other():
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from graphdsl.runtime.distributed import init_distributed, start_leaving
    seen = []
    for _ in range(2):
        init_distributed(0, 1, torch.device("cpu"), store=dist.HashStore())
        name = dist.group.WORLD.group_name
        seen.append((name, symm_mem.is_symm_mem_enabled_for_group(name)))
        symm_mem.enable_symm_mem_for_group(name)       # what the one-shot buffers' rendezvous does
        assert start_leaving().wait(30)
    return seen


def test_a_group_formed_after_a_torn_down_one_gets_a_fresh_name():
    (first, first_enabled), (second, second_enabled) = in_fresh_process(_two_groups_one_after_the_other)
    assert first != second
    assert not first_enabled
    assert not second_enabled          # the old code named both "0": already enabled, over the old store


def _names(rank, world, generation):
    import torch.distributed as dist

    from graphdsl.runtime.distributed import init_distributed
    init_distributed(rank, world, torch.device("cpu"), generation=generation)
    names = [None] * world
    dist.all_gather_object(names, dist.group.WORLD.group_name)
    return names


def test_the_ranks_of_a_group_form_it_under_one_generation():
    names = run_ranks(2, _names, 3)
    assert names == ["300", "300"]


def test_a_worker_pool_hands_its_generation_to_its_workers(monkeypatch):
    """Rank 0 numbers each pool's group, and starts its workers with that number (they are fresh
    processes, whose own count starts at 0)."""
    from graphdsl.runtime.distributed import group, workers
    started = []

    class _Proc:
        def __init__(self, target, name, daemon, args):
            started.append(args)

        def start(self):
            pass

    class _Ctx:
        Process = _Proc

        def Queue(self):
            return None
    monkeypatch.setattr(workers.mp, "get_context", lambda how: _Ctx())
    monkeypatch.setattr(torch.distributed, "TCPStore", lambda *a, **k: None)
    a = workers.WorkerPool(3, print)
    b = workers.WorkerPool(2, print)
    assert a.generation != b.generation
    assert [args[3] for args in started] == [a.generation, a.generation, b.generation]
    assert group.next_group_generation() > b.generation
