"""``build_engine``: record → lint → passes → Engine, each stage timed, dumps on request.

With the on-disk engine cache (:mod:`graphdsl.runtime.engine_cache`) a build first looks up the
optimised network under a key of (recorded graph JSON, backend + enabled passes, versions + GPU
arch); a hit loads it and skips the passes. Weights are bound after the build, never stored.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path

import torch

from graphdsl.env import env_flag
from graphdsl.errors import GraphDSLError
from graphdsl.network import Network
from graphdsl.passes.manager import PassManager

from .backends import BACKENDS
from .device import check_device
from .engine import Engine
from .engine_cache import EngineCache, environment_key

__all__ = ["build_engine", "default_backend"]

_build_ids = itertools.count()


def default_backend(device=None) -> str:
    """``"triton"`` when the engine will run on CUDA, else ``"torch"``."""
    device = check_device(device, "default_backend: device")
    if device is not None:
        return "triton" if device.type == "cuda" else "torch"
    return "triton" if torch.cuda.is_available() else "torch"


def _target_is_cuda(backend: str, device) -> bool:
    if device is not None:
        return torch.device(device).type == "cuda"
    return backend == "triton" and torch.cuda.is_available()


def _resolve_cache(cache, backend: str, device) -> EngineCache | None:
    if isinstance(cache, EngineCache):
        return cache
    if cache is not None and not isinstance(cache, bool):
        raise GraphDSLError(f"build_engine: cache must be None, True, False or an EngineCache, got {cache!r}")
    if not env_flag("GRAPHDSL_ENGINE_CACHE", True):
        return None
    if cache is None:
        cache = _target_is_cuda(backend, device)
    return EngineCache() if cache else None


def _cache_payload(work: Network, fold_constants: bool, report) -> dict:
    return {"net": work.to_json(), "fold_constants": fold_constants, "pass_report": dataclasses.asdict(report)}


def _from_payload(payload: dict):
    """``(network, fold_constants, pass report)`` from a cache entry; raises on a malformed one."""
    from graphdsl.passes.manager import BuildReport, PassRecord
    from graphdsl.passes.rewriter import NearMiss
    work = Network.from_json(payload["net"])
    work.lint()
    rep = payload["pass_report"]
    report = BuildReport(records=[PassRecord(**r) for r in rep["records"]],
                         near_misses=[NearMiss(**m) for m in rep["near_misses"]],
                         applied=[tuple(a) for a in rep["applied"]], disabled=list(rep["disabled"]))
    fold = payload["fold_constants"]
    if not isinstance(fold, bool):
        raise GraphDSLError(f"fold_constants must be a bool, got {fold!r}")
    return work, fold, report


def build_engine(net: Network, *, backend: str | None = None, device=None, dump_dir=None, passes=None,
                 disable=None, lint: bool | None = None, cache=None) -> Engine:
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
        cache: the on-disk engine cache: ``True`` (the default directory, ``$GRAPHDSL_CACHE_DIR`` or
            ``~/.cache/graphdsl``), ``False``, or an :class:`EngineCache`; default ``None``: on when
            the engine targets CUDA (``device`` is CUDA, or no device and backend ``triton`` with CUDA
            present), off on CPU. ``GRAPHDSL_ENGINE_CACHE=0`` turns it off everywhere. The key is
            the recorded graph's JSON, the backend and the enabled passes (after ``disable`` and
            ``$GRAPHDSL_DISABLE_PASSES``), and :func:`environment_key` (versions, GPU arch); a hit
            loads the optimised network and skips the passes (the build report's ``cache lookup``
            stage says ``cache hit``). While dumping (``dump_dir``) the passes always run, so their graphs are
            written, and the result is stored.
    """
    device = check_device(device, "build_engine: device")
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
    if dump_dir and os.path.exists(dump_dir) and not os.path.isdir(dump_dir):
        raise GraphDSLError(f"build_engine: dump_dir {os.fspath(dump_dir)!r} (dump_dir= or $GRAPHDSL_DUMP_DIR) "
                            "is a file, not a folder")
    out_dir = Path(dump_dir) / f"{next(_build_ids):03d}-{net.name}" if dump_dir else None
    stage("lint", net.lint)
    store = _resolve_cache(cache, backend, device)
    key = hit = None
    if store is not None:
        env_device = device if device is not None else ("cuda" if _target_is_cuda(backend, device) else None)
        key = stage("cache key", lambda: EngineCache.key(net.to_json(), {"backend": backend, "passes": list(pm.enabled)},
                                                         environment_key(env_device)))
        if out_dir is None:
            hit = stage("cache lookup", lambda: _cache_lookup(store, key), lambda r: "cache hit" if r else "cache miss")
    if hit is not None:
        work, fold_constants, passes_report = hit
    else:
        work = stage("clone", lambda: Network.from_json(net.to_json()))
        passes_report = stage("passes", lambda: pm.run(work, dump_dir=out_dir),
                              lambda r: f"{len(pm.enabled)} passes, {len(net.nodes)} -> {len(work.nodes)} nodes")
        stage("lint", work.lint)
        fold_constants = "constant_fold" in pm.enabled
        if store is not None:
            stage("cache store", lambda: store.put(key, _cache_payload(work, fold_constants, passes_report),
                                                   name=net.name), lambda p: p.name[:12])
    engine = Engine(work, be, device=device, recorded=net, build_report=report, pass_report=passes_report,
                    fold_constants=fold_constants)
    engine.cache_key = key
    if out_dir is not None:
        engine.dump(out_dir)
        engine.dump_dir = out_dir
    return engine


def _cache_lookup(store: EngineCache, key: str):
    """A cache entry's build, or None (absent; a malformed entry is removed so it gets rebuilt)."""
    payload = store.get(key)
    if payload is None:
        return None
    try:
        return _from_payload(payload)
    except (GraphDSLError, KeyError, TypeError, ValueError, AttributeError):
        store.remove(key)
        return None
