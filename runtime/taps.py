"""Taps: copy chosen intermediate tensors out of a running engine without changing its schedule.

A tap selector names tensors of the engine's (optimised) graph:

* ``NAME`` — a tensor (``add_rms_norm_4:0``) or every output of a node (``matmul_5``); failing
  that, a module path: every tensor produced by a node of that module or below it;
* ``module:PATH`` — every tensor produced inside module ``PATH`` (``model.layers.3.self_attn``);
* ``op:OP`` — every output of the nodes running op ``OP`` (``silu_mul``, ``fused``, ``matmul``);
* a selector may hold ``*`` / ``?`` globs (``module:model.layers.*.mlp``).

The engine copies each tapped tensor right after the node that writes it, from where that node's
kernel wrote it (its arena slot, an output buffer, a view of one), so the fused schedule and the
kernel count are unchanged; only copy launches are added. Inside a CUDA-graph capture the copies
go into static tap buffers (:meth:`TapSet.copier` with ``buffers``), so a replay refreshes them.

A recorded op that fusion absorbed into a kernel has no memory of its own: selecting it by name
is an error that names the fused kernel holding it (tap that kernel's output, or build with
``passes=[]`` to keep every op separate). ``GRAPHDSL_TAPS=sel1,sel2`` taps every forward of every
engine when ``taps`` is not passed; the copies land in ``engine.tapped``.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from graphdsl.errors import BindError

__all__ = ["TapSet", "kernel_for", "resolve_taps", "taps_from_env"]


def taps_from_env() -> list[str]:
    """The selectors of ``$GRAPHDSL_TAPS`` (comma separated), or ``[]``."""
    return [s.strip() for s in os.environ.get("GRAPHDSL_TAPS", "").split(",") if s.strip()]


def _in_module(node, pattern: str) -> bool:
    mod = node.module or ""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(mod, pattern) or fnmatch.fnmatchcase(mod, pattern + ".*")
    return mod == pattern or mod.startswith(pattern + ".")


def kernel_for(net, recorded, name: str):
    """The node of optimised graph ``net`` that computes recorded node (or tensor) ``name`` of
    ``recorded``: the node itself when it survived the passes, the generic fused kernel whose
    ``absorbed`` list holds it, else the node that a pattern rewrite put at the same module and
    source line (``matmul_silu_mul`` for a SwiGLU's ``silu``). None when constant folding or DCE
    removed it."""
    base = name.split(":")[0]
    for n in net.nodes:
        if n.name == base or base in n.attrs.get("absorbed", ()):
            return n
    if recorded is None:
        return None
    rec = next((n for n in recorded.nodes if n.name == base), None)
    if rec is None:
        return None
    same = [n for n in net.nodes if n.source == rec.source and n.module == rec.module]
    return same[-1] if same else None


def resolve_taps(net, selectors: Iterable[str], recorded=None) -> list:
    """The graph tensors ``selectors`` name, in schedule order (graph inputs first), no repeats."""
    selectors = [selectors] if isinstance(selectors, str) else list(selectors)
    chosen: list = []
    seen: set = set()

    def add(ts):
        for t in ts:
            if t not in seen:
                seen.add(t)
                chosen.append(t)

    for sel in selectors:
        if not isinstance(sel, str) or not sel:
            raise BindError(f"taps: each selector must be a non-empty string, got {sel!r}")
        kind, _, arg = sel.partition(":") if sel.startswith(("module:", "op:")) else ("", "", sel)
        glob = any(c in arg for c in "*?[")
        found: list = []
        if kind == "op":
            found = [t for n in net.nodes if fnmatch.fnmatchcase(n.op, arg) for t in n.outputs]
        elif kind == "module":
            found = [t for n in net.nodes if _in_module(n, arg) for t in n.outputs]
        else:
            match = (lambda s: fnmatch.fnmatchcase(s, arg)) if glob else (lambda s: s == arg)
            found = [t for n in net.nodes for t in n.outputs if match(t.name) or match(n.name)]
            found += [t for name, t in net.inputs.items() if match(name)]
            if not found:
                found = [t for n in net.nodes if _in_module(n, arg) for t in n.outputs]
        if not found:
            holder = None if glob or kind == "op" else kernel_for(net, recorded, arg)
            if holder is not None:
                raise BindError(f"taps: '{sel}' was fused into kernel '{holder.name}' ({holder.op} at {holder.source}"
                                f"{', module ' + holder.module if holder.module else ''}) and lives only in its "
                                f"registers; tap '{holder.name}' (its outputs {[t.name for t in holder.outputs]}) or "
                                "build with passes=[] to keep every op separate")
            modules = sorted({n.module for n in net.nodes if n.module})[:5]
            raise BindError(f"taps: '{sel}' names no tensor, node, module or op of graph '{net.name}' "
                            f"(tensors like {[t.name for n in net.nodes[:3] for t in n.outputs]}, modules like "
                            f"{modules}, ops like {sorted({n.op for n in net.nodes})[:6]})")
        add(found)
    return chosen


@dataclass
class TapSet:
    """Resolved taps of one engine: which tensors, and after which node each is copied."""

    tensors: list                     # graph tensors, in the order they are produced

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def copier(self, values: dict, buffers: Mapping[str, torch.Tensor] | None = None):
        """``(after, result)``: ``after(node, values)`` for the backend copies each tapped output of
        ``node`` into ``result`` (fresh clones, or ``buffers[name]`` in place: what a CUDA-graph
        capture needs); graph inputs and folded constants already in ``values`` are copied now."""
        result: dict[str, torch.Tensor] = {}
        by_node: dict = {}
        for t in self.tensors:
            if t in values:
                self._put(result, buffers, t, values[t])
            else:
                by_node.setdefault(t.producer, []).append(t)

        def after(node, vals):
            for t in by_node.get(node, ()):
                self._put(result, buffers, t, vals[t])
        return after, result

    @staticmethod
    def _put(result: dict, buffers, t, value: torch.Tensor) -> None:
        if buffers is None:
            result[t.name] = value.detach().clone()
            return
        buf = buffers.get(t.name)
        if buf is None or tuple(buf.shape) != tuple(value.shape) or buf.dtype != value.dtype:
            got = "none" if buf is None else f"{list(buf.shape)} {buf.dtype}"
            raise BindError(f"tap buffer '{t.name}': expected {list(value.shape)} {value.dtype}, got {got}")
        buf.copy_(value)
        result[t.name] = buf
