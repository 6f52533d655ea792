"""The ranks of a one-shot all-reduce simulated in one process (runtime/kernels/allreduce.py's
``local_peers``), run one after another: before a rank's call, the rows and flags of the ranks not
run yet are seeded where their pushes would put them (ranks run earlier pushed their own), so no
call waits for a rank that has not started. Under the interpreter this is the only way to run
them; on a GPU it also compiles and loads every rank's kernel before ranks run at once (a module
load while another rank's kernel spins could wait for that kernel)."""
from __future__ import annotations

import torch

from graphdsl.runtime.kernels.allreduce import MAX_ROWS, one_shot_all_reduce


def seed_later_ranks(peers, r, xs) -> None:
    """Put the rows of ranks after ``r`` into rank ``r``'s buffer and raise their flags there, as
    their pushes of the coming call would (each peer's epoch is where rank r's is)."""
    me = peers[r]
    world, region = me.world_size, me.region
    bufs, flags = me._keep
    m, h = xs[0].shape
    for p in range(m):
        e = int(me.epoch[p]) + 1
        for q in range(r + 1, world):
            at = ((e % 2) * world + q) * region + p * h
            bufs[r][at:at + h] = xs[q][p]
            flags[r][q * MAX_ROWS + p] = e


def run_in_turn(peers, xs, **kw) -> list:
    """Every rank's call, rank 0 first; ``kw`` values that are lists are per rank. Returns each
    rank's ``(out, sum_out)``."""
    outs = []
    for r, me in enumerate(peers):
        seed_later_ranks(peers, r, xs)
        out = torch.empty_like(xs[r])
        extra = {k: v[r] if isinstance(v, list) else v for k, v in kw.items()}
        one_shot_all_reduce(xs[r], me, out, **extra)
        outs.append((out, extra.get("sum_out")))
    return outs
