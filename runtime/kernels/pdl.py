"""Programmatic dependent launch (PDL) for the engine's Triton kernels.

A decode step is a chain of a few hundred short kernels, each of which waits for the one before
it; on Hopper every such boundary costs microseconds of launch and ramp-up even inside a CUDA
graph. With PDL a kernel launched with the programmatic-serialisation attribute may be scheduled
*before* its predecessor has finished: its programs start, wait at ``griddepcontrol.wait`` until
the predecessor grid has completed and its writes are visible, and only then touch memory. The
predecessor allows this early start with ``griddepcontrol.launch_dependents``. The launch of the
next kernel thus overlaps the tail of the current one, and CUDA-graph capture keeps these
programmatic edges.

The contract, kept by every kernel that takes ``USE_PDL``: call :func:`pdl_wait` before its first
memory access that depends on earlier kernels, or that writes memory earlier kernels may still
read. Reads of weights, which no kernel of a step writes, may go before it: the decode GEMVs ask
L2 for the first lines of their weight slabs there (:func:`prefetch_l2`), so their loops start on
L2 hits; everything else comes after the wait. It also lets the
next kernel launch, unless the kernel passes ``LAUNCH_NEXT=False`` and calls :func:`pdl_trigger`
later (the decode GEMV does, after its K loop, when its grid has more programs than SMs). A
kernel that is not launched this way (cuBLAS, torch ops) simply runs after its predecessor, and
a PDL kernel after it starts when it ends, so mixing is safe.

:func:`pdl_launch` returns the launch keywords: ``USE_PDL`` (a ``tl.constexpr``) and Triton's
``launch_pdl`` option, on Hopper or newer CUDA devices when the installed Triton has grid
dependency control, and not under the CPU interpreter; ``GRAPHDSL_PDL=0`` turns it off.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphdsl.env import env_flag

from ..device import triton_interprets

try:                                   # Triton >= 3.3 on NVIDIA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                    # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

__all__ = ["pdl_wait", "pdl_trigger", "pdl_launch", "pdl_available", "prefetch_l2", "hopper"]


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """Wait for the previous kernel's completion, then (``LAUNCH_NEXT``) let the next kernel launch
    early; a kernel passing ``LAUNCH_NEXT=False`` calls :func:`pdl_trigger` later itself."""
    if USE_PDL:
        gdc_wait()
        if LAUNCH_NEXT:
            gdc_launch_dependents()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has called this (or exited)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(w_rows, lo, hi, LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the first ``LINES`` 128-byte lines of each of this program's rows from element
    ``lo`` on (``w_rows [BLOCK_N, 1]``: row pointers; ``LINE`` elements a line; ``hi``: the slice's
    end), one ``prefetch.global.L2`` a line. No kernel of a step writes the weights, so this may run
    before the PDL wait, while the previous kernel finishes; the loop after the wait then finds its
    first tiles in L2 instead of paying the memory latency with nothing in flight."""
    lines = tl.arange(0, LINES) * LINE
    p = w_rows + tl.minimum(lo + lines, hi - 1)[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


def hopper(device) -> bool:
    """Whether CUDA ``device`` (the current one when it has no index) is Hopper (sm_90) or newer."""
    device = torch.device(device)
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=1)
def _triton_has_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:                # pragma: no cover
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_available(device) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module docstring for the conditions)."""
    device = torch.device(device)
    if device.type != "cuda" or triton_interprets():
        return False
    if not env_flag("GRAPHDSL_PDL", True) or not _triton_has_pdl():
        return False
    return hopper(device)


def pdl_launch(device) -> dict:
    """Launch keywords for a kernel that takes ``USE_PDL``: ``{USE_PDL, launch_pdl}`` or ``{USE_PDL}``."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_available(device) else {"USE_PDL": False}
