"""``build_engine``: record → lint → passes → Engine, each stage timed, dumps on request."""
from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from graphdsl.errors import GraphDSLError
from graphdsl.network import Network
from graphdsl.passes.dce import dead_code_elimination

from .backends import BACKENDS
from .engine import Engine

__all__ = ["build_engine"]

_build_ids = itertools.count()


def build_engine(net: Network, *, backend: str = "torch", device=None, dump_dir=None) -> Engine:
    """Compile ``net`` (left unchanged) into an :class:`Engine`.

    Args:
        backend: ``"torch"`` (reference: each op's torch implementation, CPU or CUDA).
        device: pin the engine to a device; default: the device of the first call's inputs.
        dump_dir: write graphs, plans and the summary there (default: ``$GRAPHDSL_DUMP_DIR``).
    """
    if backend not in BACKENDS:
        raise GraphDSLError(f"build_engine: unknown backend {backend!r}; available: {sorted(BACKENDS)}")
    if not net.outputs:
        raise GraphDSLError(f"network '{net.name}' has no outputs: call net.mark_output(tensor, name) first")
    report: list[tuple[str, float, str]] = []

    def stage(name, fn, info=lambda r: ""):
        t0 = time.perf_counter()
        r = fn()
        report.append((name, time.perf_counter() - t0, info(r)))
        return r

    stage("lint", net.lint)
    work = stage("clone", lambda: Network.from_json(net.to_json()))
    stage("dce", lambda: dead_code_elimination(work), lambda r: f"removed {r} nodes")
    stage("lint", work.lint)
    engine = Engine(work, BACKENDS[backend](), device=device, recorded=net, build_report=report)
    dump_dir = dump_dir or os.environ.get("GRAPHDSL_DUMP_DIR")
    if dump_dir:
        engine.dump(Path(dump_dir) / f"{next(_build_ids):03d}-{net.name}")
    return engine
