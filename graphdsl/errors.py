"""Errors raised by graphdsl, and the helper that points them at the user's source line.

Every error a user can trigger is a :class:`GraphDSLError` (or a subclass), and its message names
what was wrong, the expected value and the actual value, plus — when raised while recording — the
user's own ``file:line`` rather than a line inside graphdsl.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

__all__ = ["GraphDSLError", "ShapeError", "BindError", "user_frame"]

class GraphDSLError(Exception):
    """Base class of every error graphdsl raises on bad user input."""


class ShapeError(GraphDSLError):
    """A shape or dtype rule rejected its inputs (record time or shape propagation)."""


class BindError(GraphDSLError):
    """Real tensors given to an engine do not match what the graph declared."""


def user_frame() -> str:
    """``file:line`` of the innermost caller outside graphdsl's own language/pass/runtime code.

    Layer and model files are user code from the graph's point of view (their lines are what a
    reader wants on a node), so only the ``graphdsl``, ``graphdsl.passes`` and
    ``graphdsl.runtime`` folders are skipped — wherever they are installed — and torch's own
    (``torch.nn.functional.silu(t)`` on a graph tensor reaches graphdsl through torch's frames).
    """
    inside, outside = _internal_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = filename.startswith(inside) and not filename.startswith(outside)
        if not internal and "<frozen" not in filename:
            return f"{_short(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


@functools.lru_cache(maxsize=1)
def _internal_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders whose frames are graphdsl internals, sub-folders of those that are user-facing)."""
    def folder(name: str) -> str | None:
        spec = importlib.util.find_spec(name)
        return os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else None

    inside = tuple(d for d in map(folder, ("graphdsl", "graphdsl.passes", "graphdsl.runtime", "torch")) if d)
    outside = tuple(d for d in map(folder, ("graphdsl.layers", "graphdsl.models")) if d)
    return inside, outside


def _short(filename: str) -> str:
    cwd = os.getcwd() + os.sep
    return filename[len(cwd):] if filename.startswith(cwd) else filename
