"""``build_engine``: record → lint → passes → Engine, each stage timed, dumps on request."""
from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.network import Network
from graphdsl.passes.manager import PassManager

from .backends import BACKENDS
from .engine import Engine

__all__ = ["build_engine", "default_backend"]

_build_ids = itertools.count()


def default_backend(device=None) -> str:
    """``"triton"`` when the engine will run on CUDA, else ``"torch"``."""
    if device is not None:
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return "triton" if torch.cuda.is_available() else "torch"


def build_engine(net: Network, *, backend: str | None = None, device=None, dump_dir=None, passes=None,
                 disable=None, lint: bool | None = None) -> Engine:
    """Compile ``net`` (left unchanged) into an :class:`Engine`.

    Args:
        backend: ``"triton"`` (generated fused kernels + cuBLAS; the default on CUDA; on CPU under
            ``TRITON_INTERPRET=1``) or ``"torch"`` (each op's torch reference; the default on CPU).
        device: pin the engine to a device; default: the device of the first call's inputs.
        dump_dir: write graphs after every pass, the build report, plans, kernels and the summary
            there (default: ``$GRAPHDSL_DUMP_DIR``).
        passes: names of the passes to run (default: all, see ``graphdsl.passes.pass_names()``);
            ``[]`` runs none (the unoptimised reference).
        disable: names of passes to skip (also ``$GRAPHDSL_DISABLE_PASSES=a,b``).
        lint: ``net.lint()`` after every pass (default: on under pytest or with ``GRAPHDSL_LINT=1``).
    """
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise GraphDSLError(f"build_engine: unknown backend {backend!r}; available: {sorted(BACKENDS)}")
    if not net.outputs:
        raise GraphDSLError(f"network '{net.name}' has no outputs: call net.mark_output(tensor, name) first")
    be = BACKENDS[backend]()
    pm = PassManager(passes=passes, disable=disable, lint=lint, can_fuse=getattr(be, "can_fuse", None))
    report: list[tuple[str, float, str]] = []

    def stage(name, fn, info=lambda r: ""):
        t0 = time.perf_counter()
        r = fn()
        report.append((name, time.perf_counter() - t0, info(r)))
        return r

    dump_dir = dump_dir or os.environ.get("GRAPHDSL_DUMP_DIR")
    out_dir = Path(dump_dir) / f"{next(_build_ids):03d}-{net.name}" if dump_dir else None
    stage("lint", net.lint)
    work = stage("clone", lambda: Network.from_json(net.to_json()))
    passes_report = stage("passes", lambda: pm.run(work, dump_dir=out_dir),
                          lambda r: f"{len(pm.enabled)} passes, {len(net.nodes)} -> {len(work.nodes)} nodes")
    stage("lint", work.lint)
    engine = Engine(work, be, device=device, recorded=net, build_report=report, pass_report=passes_report,
                    fold_constants="constant_fold" in pm.enabled)
    if out_dir is not None:
        engine.dump(out_dir)
        engine.dump_dir = out_dir
    return engine
