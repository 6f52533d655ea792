"""Compile a step's Triton kernels on forked worker processes before the step runs them.

The first forward of an engine's shape compiles each Triton kernel its launches reach, one after
another, on the host thread: on a fresh H200 the first decode and prefill steps of the 8B engines
spent about 9 s so — 17 kernel compiles (5.4 s) and their 17 launchers, each a C extension built with
the host compiler (3.5 s; docs/performance-log.md). Threads do not help (Triton's compiler holds the
GIL); processes do. :func:`run_ahead` runs a first forward in three passes:

1. **watched** — the forward runs with Triton's ``jit_cache_hook`` watching its compiles. A kernel
   specialisation this process has not compiled but Triton's disk cache holds loads as usual, so a
   warm start costs nothing more. At the first one the disk cache does not hold, the forward turns
   *dry* for the rest of the call: that launch and every later one are skipped (compiled kernels
   too) and each specialisation not compiled in the process is recorded. Torch ops still run (the
   caller zeroes the engine's arena as the pass turns dry, so they read zeros, not stale indices;
   the Triton backend skips its cuBLAS products while :func:`dry_pass_running`). Only the calling
   thread's launches are watched. What ran before the turn is real and idempotent (kernels write
   their outputs; a cache write writes the same values again when the forward reruns).
2. **disk** — each recorded specialisation goes through Triton's own compile path with a cache that
   may not compile: one that Triton's disk cache holds is loaded into the process, one it does not is
   a *miss*.
3. **workers** — the misses are handed out, one at a time as each frees up, to forked copies of this
   process (:class:`_Worker`). A fork has every kernel object already, so it imports nothing (a fresh
   interpreter spent 6 s importing torch and graphdsl on the H200 machine). It replaces Triton's
   driver with :class:`OfflineDriver`, so it never touches the CUDA context it inherited, compiles
   into Triton's disk cache and builds the launcher there, then exits. The caller then runs the
   forward again, for real, and it loads them.

Until session 59 the first pass was dry from the start, so every new plan paid a dry pass, even
one whose kernels were all on disk: a server's warm-up (66 new plans, 1B, an H200) took 8.9 s
against 5.2 s compiling one by one.

Nothing here decides what runs: a kernel whose precompile fails for any reason (a worker that dies or
hangs past :data:`TASK_TIMEOUT_S`, a kernel defined inside a function, a Triton without these hooks)
is compiled by the real forward as before, which reports a real compile error as it always did.
``GRAPHDSL_COMPILE_WORKERS`` sets the number of workers (0 or 1: compile in the forward, as before).
:data:`history` keeps an :class:`AheadReport` per call.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field

from graphdsl.env import env_number

from .device import triton_interprets

__all__ = ["AheadReport", "Deferred", "OfflineDriver", "TASK_TIMEOUT_S", "applies", "defer_launches", "dry_pass_running",
           "history", "load_cached", "num_workers", "on_disk", "run_ahead", "run_watched", "watching"]

TASK_TIMEOUT_S = 300.0       # a worker's compile of one kernel past this is given up (the forward compiles it)
_MAX_WORKERS = 16


@dataclass(frozen=True)
class Deferred:
    """A kernel specialisation the dry pass skipped: its ``JITFunction`` (``jit``, named by ``module``
    and ``qualname``) and Triton's serialised specialisation (``spec``)."""

    module: str
    qualname: str
    spec: str
    jit: object = field(compare=False, repr=False, default=None)


@dataclass
class AheadReport:
    """One :func:`run_ahead` call that went dry: kernels ``deferred`` by the dry part (``kernels``:
    their names), ``on_disk`` (loaded from Triton's cache), ``compiled`` by workers (``launchers``:
    of which the launcher was built too), ``failed`` (``(qualname, reason)``: left to the forward),
    ``workers`` used (``killed``: those that did not exit when their tasks were done) and the wall
    ``seconds``; ``dry_error`` when the forward raised in its dry part."""

    label: str
    deferred: int = 0
    kernels: list[str] = field(default_factory=list)     # the deferred kernels' names, in launch order
    on_disk: int = 0
    compiled: int = 0
    launchers: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    workers: int = 0
    killed: int = 0
    seconds: float = 0.0
    dry_error: str | None = None

    def __str__(self) -> str:
        s = (f"{self.label}: {self.deferred} kernels to compile, {self.on_disk} on disk, {self.compiled} "
             f"compiled ({self.launchers} with their launchers) on {self.workers} workers in {self.seconds:.2f} s")
        if self.failed:
            s += f"; {len(self.failed)} left to the forward ({self.failed[0][0]}: {self.failed[0][1]})"
        return s + (f"; dry pass stopped: {self.dry_error}" if self.dry_error else "")


history: list[AheadReport] = []        # the run_ahead calls that went dry
_lock = threading.RLock()
_state = threading.local()           # .dry: this thread is in a dry pass; .watcher: its innermost watch


def dry_pass_running() -> bool:
    """Whether this thread's launches are in a dry pass (:func:`run_ahead` once it turned dry, or
    :class:`defer_launches`)."""
    return getattr(_state, "dry", False)


def applies(device) -> bool:
    """Whether a first call on ``device`` may run watched (:func:`run_ahead`): CUDA, not under
    Triton's interpreter, not during a CUDA-graph capture, ``GRAPHDSL_COMPILE_WORKERS`` 2 or more."""
    import torch
    return (torch.device(device).type == "cuda" and not triton_interprets()
            and num_workers() >= 2 and not torch.cuda.is_current_stream_capturing())


def num_workers() -> int:
    """``$GRAPHDSL_COMPILE_WORKERS``, else the CPU count up to 16."""
    return int(env_number("GRAPHDSL_COMPILE_WORKERS", min(_MAX_WORKERS, os.cpu_count() or 1), integer=True))


# -- pass 1: the watched forward, and its dry part ------------------------------------------------
class defer_launches:
    """Context manager watching the Triton launches of this thread; other threads' launches run, and
    go to the hook that was set before (if any).

    ``dry=True``: no launch runs. A specialisation this process has not compiled is appended to
    ``self.found`` as :class:`Deferred`; one it has is looked up (Triton's ``warmup`` path) and not
    launched either. ``dry=False`` (:func:`run_ahead`): launches run, and a specialisation this
    process has not compiled loads from Triton's disk cache as usual, until the first one the disk
    cache does not hold. There the pass turns dry for good (``went_dry``; ``on_dry()`` is called
    first): that launch and every later one are skipped as above.

    Not launching the compiled kernels in the dry part matters as much as deferring the others: a
    skipped kernel's output left in a fresh ``torch.empty`` buffer is garbage, and a compiled kernel
    reading it as indices (an MoE's expert rows, after the grouping kernel was skipped for a new
    token count) reads out of bounds (an H200, session 59: an illegal address)."""

    _depth = 0                 # passes entered (run_ahead's lock keeps its own on one thread at a time)
    _run = None                # JITFunction.run as Triton defines it, while patched

    def __init__(self, dry: bool = True, on_dry=None):
        self.found: list[Deferred] = []
        self.went_dry = False
        self._start_dry = dry
        self.on_dry = [] if on_dry is None else [on_dry]     # called as the pass turns dry
        self._thread = threading.get_ident()
        self._previous = None
        self._was_dry = False
        self._probing = False

    def __enter__(self) -> "defer_launches":
        from triton import knobs
        from triton.runtime.jit import JITFunction
        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        if defer_launches._depth == 0:
            defer_launches._run = run = JITFunction.run
            threads = _dry_threads

            def run_or_look_up(fn, *args, grid, warmup, **kwargs):
                return run(fn, *args, grid=grid, warmup=warmup or threading.get_ident() in threads, **kwargs)
            JITFunction.run = run_or_look_up
        defer_launches._depth += 1
        self._outer = getattr(_state, "watcher", None)
        _state.watcher = self
        if self._start_dry:
            self._go_dry()
        return self

    def _go_dry(self) -> None:
        for fn in self.on_dry:
            fn()
        self.went_dry = True
        self._was_dry = dry_pass_running()
        _state.dry = True
        _dry_threads[self._thread] = _dry_threads.get(self._thread, 0) + 1

    def __exit__(self, *exc) -> None:
        from triton import knobs
        from triton.runtime.jit import JITFunction
        knobs.runtime.jit_cache_hook = self._previous
        if self.went_dry:
            _state.dry = self._was_dry
            left = _dry_threads[self._thread] - 1
            if left:
                _dry_threads[self._thread] = left
            else:
                del _dry_threads[self._thread]
        _state.watcher = self._outer
        defer_launches._depth -= 1
        if defer_launches._depth == 0:
            JITFunction.run = defer_launches._run
            defer_launches._run = None

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled, **rest):
        if threading.get_ident() != self._thread:
            if self._previous is None:
                return None
            return self._previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                  already_compiled=already_compiled, **rest)
        if self._probing:                    # on_disk's own lookup (preload calls this hook too)
            return None
        found = Deferred(str(fn.module), fn.name, compile["specialization_data"], fn.jit_function)
        if not self.went_dry:
            self._probing = True
            try:
                held = on_disk(found)
            finally:
                self._probing = False
            if held:
                return None                  # Triton loads it, as on any warm start
            self._go_dry()
        self.found.append(found)
        return True


_dry_threads: dict[int, int] = {}     # thread id -> dry passes entered on it and not yet left


def watching() -> bool:
    """Whether this thread's Triton launches are being watched (:func:`run_ahead`, a dry pass)."""
    return getattr(_state, "watcher", None) is not None


# -- pass 2: what Triton's disk cache already holds -------------------------------------------------
class _NotCached(Exception):
    pass


class _Found(Exception):
    pass


class _lookup_only:
    """Context manager: this thread's Triton compiles may load from the disk cache but not compile
    (a miss raises :class:`_NotCached`); with ``probe``, not load either (a hit raises
    :class:`_Found`). Wraps the cache-manager factory Triton's ``compile`` calls."""

    def __init__(self, probe: bool = False):
        from triton.compiler import compiler
        self._module = compiler
        self._thread = threading.get_ident()
        self._probe = probe

    def __enter__(self):
        self._factory = factory = self._module.get_cache_manager
        thread, probe = self._thread, self._probe

        def lookup(key):
            manager = factory(key)
            if threading.get_ident() != thread:
                return manager
            get_group = manager.get_group

            def group_or_miss(filename):
                group = get_group(filename)
                if not group or group.get(filename) is None:
                    raise _NotCached(filename)
                if probe:
                    raise _Found(filename)
                return group
            manager.get_group = group_or_miss
            return manager
        self._module.get_cache_manager = lookup
        return self

    def __exit__(self, *exc):
        self._module.get_cache_manager = self._factory


def on_disk(d: Deferred) -> bool:
    """Whether Triton's disk cache holds ``d`` (nothing is compiled or loaded; a specialisation that
    cannot be looked up counts as missing)."""
    with _lookup_only(probe=True):
        try:
            d.jit.preload(d.spec)
        except _Found:
            return True
        except Exception:
            return False
    return True


def load_cached(found: list[Deferred]) -> tuple[list[Deferred], list[tuple[str, str]]]:
    """Load each of ``found`` that Triton's disk cache holds into this process. Returns the misses
    and ``(qualname, reason)`` for those that could not be looked up (left to the forward)."""
    misses, failed = [], []
    with _lookup_only():
        for d in found:
            try:
                d.jit.preload(d.spec)
            except _NotCached:
                misses.append(d)
            except Exception as e:
                failed.append((d.qualname, f"{type(e).__name__}: {e}"[:300]))
    return misses, failed


# -- pass 3: the workers ---------------------------------------------------------------------------------
class OfflineDriver:
    """What Triton's compile path asks of its driver, answered without a GPU: device 0, its default
    stream, and ``target`` (a ``GPUTarget``). A worker makes it Triton's driver, so it never touches
    the CUDA context it inherited."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _build_launcher(kernel) -> str | None:
    """Build ``kernel``'s launcher into the cache where Triton makes one per signature (3.6: a C
    extension); None when built, else why not (Triton 3.9 builds none; the forward does what is left)."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        CudaLauncher(kernel.src, kernel.metadata)
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:200]
    return None


def _serve(misses: list[Deferred], target, tasks, replies) -> None:
    """A worker's loop: for each index read from ``tasks``, compile that miss into Triton's disk cache
    and build its launcher; answer on ``replies`` one JSON line per task."""
    from triton.runtime.driver import driver
    driver.set_active(OfflineDriver(target))
    for line in tasks:
        i = int(line)
        t0 = time.perf_counter()
        try:
            kernel = misses[i].jit.preload(misses[i].spec)
            reply = {"i": i, "ok": True, "launcher": _build_launcher(kernel)}
        except Exception as e:                     # the forward compiles it then, and reports
            reply = {"i": i, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        reply["seconds"] = round(time.perf_counter() - t0, 3)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class _Worker:
    """A forked copy of this process running :func:`_serve`: it has every kernel the parent has
    imported or generated, so it imports nothing. Its stdout and stderr go to /dev/null."""

    def __init__(self, misses: list[Deferred], target, siblings: list["_Worker"] = ()):
        task_r, task_w = os.pipe()
        reply_r, reply_w = os.pipe()
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        if saved is None:      # else tokenizers' fork handler warns on the terminal, in the child
            os.environ["TOKENIZERS_PARALLELISM"] = "true"
        try:
            with warnings.catch_warnings():      # "multi-threaded, use of fork() may lead to deadlocks":
                warnings.simplefilter("ignore", DeprecationWarning)   # the child takes no lock but Triton's
                pid = os.fork()
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
        if pid == 0:                                # the child
            code = 1
            try:
                os.close(task_w)
                os.close(reply_r)
                for w in siblings:     # the ends of the workers forked before: held here, their pipes
                    w.tasks.close()    # would never reach end of file, and those workers never exit
                    w.replies.close()
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                with os.fdopen(task_r) as tasks, os.fdopen(reply_w, "w") as replies:
                    _serve(misses, target, tasks, replies)
                code = 0
            finally:
                os._exit(code)
        os.close(task_r)
        os.close(reply_w)
        self.pid = pid
        self.tasks = os.fdopen(task_w, "w")
        self.replies = os.fdopen(reply_r)

    def send(self, i: int) -> bool:
        try:
            self.tasks.write(f"{i}\n")
            self.tasks.flush()
            return True
        except OSError:
            return False

    def close(self, wait_s: float = 2.0) -> bool:
        """Close the pipes (the worker's loop ends and it exits); one still running after ``wait_s``
        seconds (a hung compile) is killed. Returns whether it had to be."""
        for f in (self.tasks, self.replies):
            try:
                f.close()
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while True:
            try:
                pid, _status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid:
                return False
            if time.monotonic() >= deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return True
            time.sleep(0.005)


def _run_workers(misses: list[Deferred], count: int, target) -> tuple[dict[int, dict], int]:
    """Compile ``misses`` on ``count`` forked workers, handing out one task at a time as each frees
    up; returns the replies by index and how many workers had to be killed at the end. A worker that
    dies, or a task past :data:`TASK_TIMEOUT_S`, answers with an error."""
    workers = []
    try:
        for _ in range(count):
            workers.append(_Worker(misses, target, list(workers)))
    except OSError:                 # no more processes: those forked do it all
        if not workers:
            raise
    queue, busy, replies, hung = list(range(len(misses))), {}, {}, set()
    sel = selectors.DefaultSelector()
    try:
        for w in workers:
            sel.register(w.replies, selectors.EVENT_READ, w)

        def feed(w) -> None:
            while queue:
                i = queue.pop(0)
                if w.send(i):
                    busy[w] = (i, time.monotonic())
                    return
                replies[i] = {"ok": False, "error": "worker gone"}
        for w in workers:
            feed(w)
        while busy:
            ready = sel.select(timeout=min(5.0, TASK_TIMEOUT_S))
            for key, _ in ready:
                w = key.data
                line = w.replies.readline()
                i, _t = busy.pop(w, (None, 0))
                if not line:                       # the worker died
                    sel.unregister(w.replies)
                    if i is not None:
                        replies[i] = {"ok": False, "error": "worker exited"}
                    continue
                reply = json.loads(line)
                replies[reply["i"]] = reply
                feed(w)
            now = time.monotonic()
            for w, (i, t) in list(busy.items()):
                if now - t > TASK_TIMEOUT_S:
                    busy.pop(w)
                    hung.add(w)
                    sel.unregister(w.replies)
                    replies[i] = {"ok": False, "error": f"no answer in {TASK_TIMEOUT_S:.0f} s"}
    except BaseException:                       # Ctrl-C: do not wait for the workers
        sel.close()
        for w in workers:
            w.close(0.0)
        raise
    sel.close()
    killed = sum(w.close(0.0 if w in hung else 2.0) for w in workers)
    return replies, killed


def _compile(found: list[Deferred], workers: int, report: AheadReport) -> None:
    """Passes 2 and 3 for ``found``, filling in ``report``."""
    misses, report.failed = load_cached(found) if found else ([], [])
    report.on_disk = len(found) - len(misses) - len(report.failed)
    if not misses:
        return
    if workers < 2 or not hasattr(os, "fork"):
        report.failed += [(d.qualname, "no workers") for d in misses]
        return
    from triton.runtime.driver import driver
    report.workers = min(workers, len(misses))
    replies, report.killed = _run_workers(misses, report.workers, driver.active.get_current_target())
    for i, d in enumerate(misses):
        r = replies.get(i, {"ok": False, "error": "no reply"})
        if r.get("ok"):
            report.compiled += 1
            report.launchers += r.get("launcher") is None
        else:
            report.failed.append((d.qualname, r.get("error", "")))


def run_ahead(forward, label: str = "forward", *, on_dry=None, workers: int | None = None) -> AheadReport | None:
    """Run ``forward()``, a forward meeting new kernel specialisations, as the module docstring says:
    watched, real up to the first Triton kernel missing from the disk cache, dry from there
    (``on_dry()`` first: the caller zeroes its arena), then the misses compiled on workers.

    Returns None when the forward ran through (every kernel compiled in this process or loaded
    from disk: nothing else was done), else the :class:`AheadReport` (also appended to
    :data:`history`): then the forward's results are garbage and the caller runs it again, which
    loads every kernel. A forward raising before it went dry raises here; after, the report keeps
    the error (``dry_error``) and what was recorded is compiled. Called while this thread is already
    watched (a graph runner's step whose engine forward meets a new plan), ``forward()`` runs in that
    watch (``on_dry`` is called if it is dry or turns dry meanwhile) and None is returned."""
    outer = getattr(_state, "watcher", None)
    if outer is not None:                  # the outer watch records; this caller's arena must turn too
        if on_dry is None:
            forward()
        elif outer.went_dry:
            on_dry()
            forward()
        else:
            outer.on_dry.append(on_dry)
            try:
                forward()
            finally:
                outer.on_dry.remove(on_dry)
        return None
    workers = num_workers() if workers is None else workers
    t0 = time.perf_counter()
    with _lock:
        watch = defer_launches(dry=False, on_dry=on_dry)
        error = None
        with watch:
            try:
                forward()
            except Exception as e:
                if not watch.went_dry:
                    raise
                error = f"{type(e).__name__}: {e}"[:300]       # what it recorded is still worth compiling
        if not watch.went_dry:
            return None
        unique = list(dict.fromkeys(watch.found))
        report = AheadReport(label, deferred=len(unique), kernels=[d.qualname for d in unique], dry_error=error)
        try:
            _compile(unique, workers, report)
        except Exception as e:              # e.g. a Triton without these internals: the forward compiles
            report.failed.append(("precompile", f"{type(e).__name__}: {e}"[:300]))
    report.seconds = time.perf_counter() - t0
    history.append(report)
    return report


def run_watched(first, label: str, *, again=None, on_dry=None):
    """``first()`` through :func:`run_ahead`, and its result; if it went dry (its result is
    garbage) the result of ``again()`` (default ``first``), which loads every kernel. ``again``
    differs where ``first`` works on copies of what a dry part may spoil (a draw's logits)."""
    out = []
    if run_ahead(lambda: out.append(first()), label, on_dry=on_dry) is None:
        return out[0]
    return (again or first)()
