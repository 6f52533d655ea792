"""What a kernel boundary costs inside a CUDA graph: chains of dependent launches, timed per link.

    python benchmarks/boundary.py [--links 160] [--sizes 2048,4096]

A batch-1 decode step is a chain of about five dependent kernels a layer, each waiting for the one
before (``runtime/kernels/pdl.py``). This times chains of ``--links`` such kernels captured in one
CUDA graph and replayed, and prints µs per link:

* **empty**: one program per SM; each waits for its predecessor and stores one value. With PDL
  (the engine's default: the wait, then the trigger that lets the next kernel launch), without it,
  and with the trigger before the wait.
* **row**: the same, but each program first reads the predecessor's whole output row (``n``
  bf16 values from L2, as a GEMV reads its activation row) and writes its slice of the next row,
  so every link depends on every program of the one before, as in the model; and the same with
  the dependency kept by arrival counters instead of the PDL wait (:func:`_flag_link`: each link
  launches at once and spins until every program of the one before has counted its stores).
* **gemv**: the engine's decode GEMV (:func:`graphdsl.runtime.kernels.gemv.gemv`) chained on
  square ``[n, n]`` bf16 weights, a distinct weight per link (at least 256 MB in all, so every
  weight streams from HBM): µs a link against its bytes at the measured copy bandwidth. ``n`` =
  2048 is Llama-3.2-1B's o projection, 4096 Llama-3-8B's.

The difference between a link's time and its bytes at copy bandwidth is what the boundary costs
that link: the wait's release, the reads after it, the stores before the grid completes. Needs a
CUDA GPU (Hopper for PDL).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, copy_bandwidth_gbs, device_line, graph_ms  # noqa: E402

from graphdsl.runtime.kernels.pdl import pdl_available, pdl_trigger, pdl_wait  # noqa: E402


@triton.jit
def _link(x_ptr, y_ptr, N, OUT: tl.constexpr, ROW: tl.constexpr, READ: tl.constexpr, USE_PDL: tl.constexpr,
          EARLY: tl.constexpr):
    """Program ``p``: (``READ``) sum the predecessor's row ``x [N]`` (``ROW`` = N padded), then store
    ``OUT`` values of the next row at ``y[p * OUT:]``. ``EARLY``: let the next kernel launch before the
    wait instead of after it."""
    pid = tl.program_id(0)
    if EARLY:
        pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL, not EARLY)
    acc = 0.0
    if READ:
        r = tl.arange(0, ROW)
        acc = tl.sum(tl.load(x_ptr + r, mask=r < N, other=0.0).to(tl.float32))
    o = tl.arange(0, OUT)
    tl.store(y_ptr + pid * OUT + o, (acc * 1e-3 + o).to(y_ptr.dtype.element_ty), mask=pid * OUT + o < N)


@triton.jit
def _flag_link(x_ptr, y_ptr, count_ptr, i, links, N, PROGRAMS, OUT: tl.constexpr, ROW: tl.constexpr):
    """:func:`_link` of a ``row`` chain with the dependency kept by arrival counters instead of the PDL
    wait: link ``i`` (but the first) spins until all ``PROGRAMS`` programs of link ``i - 1`` have
    counted their stores (release/acquire), then stores its slice and counts itself. The next link
    may launch at once (it never waits for this grid); program 0 zeroes the counter of link
    ``i - 2``, whose readers are all past it (the first two links zero the last two counters, read
    only by the previous replay)."""
    pid = tl.program_id(0)
    pdl_trigger(True)
    if i > 0:
        while tl.atomic_add(count_ptr + i - 1, 0, sem="acquire") < PROGRAMS:
            pass
    if pid == 0:
        tl.atomic_xchg(count_ptr + (i + links - 2) % links, 0, sem="relaxed")
    r = tl.arange(0, ROW)
    acc = tl.sum(tl.load(x_ptr + r, mask=r < N, other=0.0, cache_modifier=".cg").to(tl.float32))
    o = tl.arange(0, OUT)
    tl.store(y_ptr + pid * OUT + o, (acc * 1e-3 + o).to(y_ptr.dtype.element_ty), mask=pid * OUT + o < N)
    tl.debug_barrier()
    tl.atomic_add(count_ptr + i, 1, sem="release")


def _graph_us(chain, links: int) -> float:
    """µs per link of ``chain()`` (``links`` dependent launches) replayed from one CUDA graph."""
    return graph_ms(chain, warmup_ms=20, rep_ms=100) * 1e3 / links


def link_chain(n: int, links: int, *, read: bool, pdl: bool, early: bool = False) -> float:
    """µs per link of ``links`` :func:`_link` kernels (one program per SM) over rows of ``n`` bf16."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [torch.zeros(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    out = triton.next_power_of_2(triton.cdiv(n, sms))
    extra = {"launch_pdl": True} if pdl else {}

    def chain():
        for i in range(links):
            _link[(sms,)](rows[i % 2], rows[1 - i % 2], n, OUT=out, ROW=triton.next_power_of_2(n), READ=read,
                          USE_PDL=pdl, EARLY=early, **extra)
    return _graph_us(chain, links)


def flag_chain(n: int, links: int) -> float:
    """µs per link of ``links`` :func:`_flag_link` kernels (one program per SM, PDL launches, no waits)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [torch.zeros(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    counts = torch.zeros(links, device="cuda", dtype=torch.int32)
    out = triton.next_power_of_2(triton.cdiv(n, sms))

    def chain():
        for i in range(links):
            _flag_link[(sms,)](rows[i % 2], rows[1 - i % 2], counts, i, links, n, sms, OUT=out,
                               ROW=triton.next_power_of_2(n), launch_pdl=True)
    return _graph_us(chain, links)


def gemv_chain(n: int, links: int) -> tuple[float, int]:
    """µs per link of ``links`` decode GEMVs ``x <- x @ W_i.T`` (one row, bf16 ``[n, n]``), and a link's bytes."""
    from graphdsl.runtime.kernels.gemv import GemvWorkspace, gemv
    nbytes = n * n * 2
    copies = max(2, -(-(256 << 20) // nbytes))
    weights = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5 for _ in range(min(copies, links))]
    rows = [torch.randn(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ws = GemvWorkspace()

    def chain():
        for i in range(links):
            gemv(rows[i % 2], weights[i % len(weights)], out=rows[1 - i % 2], workspace=ws)
    us = _graph_us(chain, links)
    del weights
    torch.cuda.empty_cache()
    return us, nbytes


def _sizes(text: str) -> list[int]:
    return [at_least(16)(part) for part in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=at_least(2), default=160,
                    help="dependent launches a graph, at least 2 (160: about a Llama-3-8B step)")
    ap.add_argument("--sizes", type=_sizes, default=[2048, 4096],
                    help="row lengths n, comma-separated integers >= 16 (default 2048,4096)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("boundary.py needs a CUDA GPU", file=sys.stderr)
        return 2
    pdl = pdl_available("cuda")
    copy = copy_bandwidth_gbs()
    print(device_line() + f"; copy bandwidth {copy:.0f} GB/s; PDL {'on' if pdl else 'unavailable'}; "
          f"{args.links} links a graph\n")
    print("| chain | n | µs a link | bytes a link at copy bandwidth, µs | boundary, µs |")
    print("|---|---:|---:|---:|---:|")
    for n in args.sizes:
        cases = [("empty, no PDL", False, False, False), ("row, no PDL", True, False, False)]
        if pdl:
            cases += [("empty, PDL", False, True, False), ("empty, PDL, trigger before the wait", False, True, True),
                      ("row, PDL", True, True, False), ("row, PDL, trigger before the wait", True, True, True)]
        for name, read, on, early in cases:
            us = link_chain(n, args.links, read=read, pdl=on, early=early)
            print(f"| {name} | {n} | {us:.2f} | | {us:.2f} |", flush=True)
        if pdl:
            us = flag_chain(n, args.links)
            print(f"| row, arrival counters instead of the wait | {n} | {us:.2f} | | {us:.2f} |", flush=True)
        us, nbytes = gemv_chain(n, args.links)
        at_copy = nbytes / (copy * 1e9) * 1e6
        print(f"| decode GEMV [{n}, {n}] bf16{', PDL' if pdl else ''} | {n} | {us:.2f} | {at_copy:.2f} | "
              f"{us - at_copy:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
