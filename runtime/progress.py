"""One status line for long work (loading weights, ``LLM.generate`` over many prompts).

On a terminal the line is redrawn in place (carriage return) a few times a second; on anything else
(a pipe, a log file) it is a plain whole line every ``plain_every`` seconds, so logs hold no ``\\r``
fragments. ``quiet_s`` keeps work that ends quickly silent: nothing shows before it has run that
long, and :meth:`ProgressLine.done` says nothing for work that never showed (``always=False``).
"""
from __future__ import annotations

import time

__all__ = ["ProgressLine"]


class ProgressLine:
    """A status line on ``stream``; call :meth:`show` when :meth:`due`, then :meth:`done` once."""

    def __init__(self, stream, *, tty_every: float = 0.2, plain_every: float = 10.0, quiet_s: float = 0.0):
        self.stream = stream
        isatty = getattr(stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.every = tty_every if self.tty else plain_every
        self.t0 = time.monotonic()
        self.last = self.t0 + max(quiet_s - self.every, 0.0)    # the first show is due after max(every, quiet_s)
        self.shown = False

    def due(self) -> bool:
        """True when the next :meth:`show` would not come too soon after the last one."""
        return time.monotonic() - self.last >= self.every

    def show(self, text: str) -> None:
        """Show ``text`` with the elapsed time."""
        now = self.last = time.monotonic()
        self.shown = True
        msg = f"{text} {now - self.t0:.1f}s"
        if self.tty:
            print(f"\r{msg}", end="", file=self.stream, flush=True)
        else:
            print(msg, file=self.stream, flush=True)

    def done(self, text: str, *, always: bool = True) -> None:
        """End the line with ``text`` and the total time (with ``always=False``, only if it showed)."""
        if not (always or self.shown):
            return
        msg = f"{text} in {time.monotonic() - self.t0:.1f}s"
        print(f"\r{msg}\033[K" if self.tty else msg, file=self.stream, flush=True)
