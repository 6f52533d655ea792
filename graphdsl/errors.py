"""Errors raised by graphdsl, and the helper that points them at the user's source line.

Every error a user can trigger is a :class:`GraphDSLError` (or a subclass), and its message names
what was wrong, the expected value and the actual value, plus — when raised while recording — the
user's own ``file:line`` rather than a line inside graphdsl.
"""
from __future__ import annotations

import os
import sys

__all__ = ["GraphDSLError", "ShapeError", "BindError", "user_frame"]

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_DIRS = tuple(
    os.path.join(_PKG_ROOT, d) + os.sep for d in ("graphdsl", "passes", "runtime")
)


class GraphDSLError(Exception):
    """Base class of every error graphdsl raises on bad user input."""


class ShapeError(GraphDSLError):
    """A shape or dtype rule rejected its inputs (record time or shape propagation)."""


class BindError(GraphDSLError):
    """Real tensors given to an engine do not match what the graph declared."""


def user_frame() -> str:
    """``file:line`` of the innermost caller outside graphdsl's own language/pass/runtime code.

    Layer and model files are user code from the graph's point of view (their lines are what a
    reader wants on a node), so only ``graphdsl/``, ``passes/`` and ``runtime/`` frames are
    skipped.
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_INTERNAL_DIRS) and "<frozen" not in filename:
            return f"{_short(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _short(filename: str) -> str:
    cwd = os.getcwd() + os.sep
    return filename[len(cwd):] if filename.startswith(cwd) else filename
