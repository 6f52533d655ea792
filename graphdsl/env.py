"""Every ``GRAPHDSL_*`` environment variable graphdsl reads, in one table, and the one way to read an
on/off switch.

:data:`ENV_VARS` names each variable with its default and meaning (``graphdsl env`` prints it with
the values set; docs/debugging.md holds the same table). :func:`env_flag` reads a switch:
``1``/``true``/``on``/``yes`` or ``0``/``false``/``off``/``no`` (any case), unset or empty for the
default; any other value is an error naming the variable, the accepted values and the value given,
where a misspelt value used to leave the switch at its default without a word. :func:`env_number`
reads a number the same way (a bad one was a bare ``ValueError``).
:func:`unknown_env_vars` lists set ``GRAPHDSL_*`` names that no code reads (a misspelt name), each with
the closest known one; ``LLM`` warns of them once a process (:func:`warn_unknown_env_vars`).
"""
from __future__ import annotations

import difflib
import os
from typing import NamedTuple

from .errors import GraphDSLError

__all__ = ["EnvVar", "ENV_VARS", "env_flag", "env_number", "unknown_env_vars", "warn_unknown_env_vars"]


class EnvVar(NamedTuple):
    default: str          # what applies when the variable is unset, in words
    meaning: str          # one line: what it does
    doc: str              # where it is explained


ENV_VARS: dict[str, EnvVar] = {
    # building engines
    "GRAPHDSL_DUMP_DIR": EnvVar("unset", "every build writes its graph after each pass, the kernel sources, "
                                "the memory plan and a summary under this directory", "docs/debugging.md"),
    "GRAPHDSL_DISABLE_PASSES": EnvVar("unset", "comma-separated pass names every build skips", "docs/passes.md"),
    "GRAPHDSL_LINT": EnvVar("0; 1 under pytest", "1: lint the graph after every pass, naming the pass that "
                            "broke it", "docs/passes.md"),
    "GRAPHDSL_ENGINE_CACHE": EnvVar("1", "0: no engine cache, in memory or on disk", "docs/runtime.md"),
    "GRAPHDSL_CACHE_DIR": EnvVar("~/.cache/graphdsl", "the on-disk engine cache (`graphdsl cache` lists and "
                                 "clears it)", "docs/runtime.md"),
    "GRAPHDSL_COMPILE_WORKERS": EnvVar("the CPU count, up to 16", "processes that compile a new shape's Triton "
                                       "kernels before its first step; 0 or 1: the step compiles them one by one",
                                       "docs/runtime.md"),
    "GRAPHDSL_KERNEL_CACHE": EnvVar("$TMPDIR/graphdsl-kernels-<uid>", "where generated Triton kernels are "
                                    "written and imported from", "docs/passes.md"),
    # running them
    "GRAPHDSL_TAPS": EnvVar("unset", "comma-separated tap selectors: every engine forward copies the matching "
                            "intermediate tensors into engine.tapped", "docs/debugging.md"),
    "GRAPHDSL_CUDA_GRAPHS": EnvVar("1", "0: no CUDA graphs (decode or prefill); every step runs eagerly",
                                   "docs/runtime.md"),
    "GRAPHDSL_PREFILL_GRAPHS": EnvVar("1", "0: no prefill CUDA graphs (decode keeps its)", "docs/runtime.md"),
    "GRAPHDSL_PREFILL_BUCKETS": EnvVar("1 on CUDA, 0 elsewhere", "pad prefill steps to shape buckets",
                                       "docs/runtime.md"),
    "GRAPHDSL_PDL": EnvVar("1", "0: kernels on Hopper launch without programmatic dependent launch",
                           "docs/runtime.md"),
    "GRAPHDSL_OVERLAP": EnvVar("1", "0: the serving loop reads every step's tokens before it launches the "
                               "next (debugging)", "docs/runtime.md"),
    # tensor parallelism
    "GRAPHDSL_ALLREDUCE": EnvVar("auto", "auto, symm_mem or nccl: the all-reduce path (auto: the one-shot "
                                 "kernel where the GPUs reach each other's memory)", "docs/distributed.md"),
    "GRAPHDSL_ONESHOT_MAX_BYTES": EnvVar("524288", "the largest all-reduce, in bytes, on the one-shot path",
                                         "docs/distributed.md"),
    "GRAPHDSL_TP_CARRY": EnvVar("0", "1: the GEMVs after an all-reduce carry it (slower on two H200s)",
                                "docs/distributed.md"),
    "GRAPHDSL_TP_CUDA_GRAPHS": EnvVar("1", "0: tensor-parallel decode steps run eagerly, each announced with "
                                      "its inputs", "docs/distributed.md"),
    "GRAPHDSL_DIST_TIMEOUT_S": EnvVar("600", "seconds a collective or a rendezvous waits for the other ranks",
                                      "docs/distributed.md"),
}

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    """The on/off switch ``$name`` (one of :data:`ENV_VARS`): ``default`` when unset or empty."""
    if name not in ENV_VARS:
        raise GraphDSLError(f"env_flag: {name!r} is not a graphdsl environment variable (graphdsl/env.py)")
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise GraphDSLError(f"{name} must be one of {'/'.join(_ON)} (on) or {'/'.join(_OFF)} (off), "
                        f"got {os.environ[name]!r}")


def env_number(name: str, default: float, *, integer: bool = False, minimum: float = 0.0) -> float:
    """The number ``$name`` (one of :data:`ENV_VARS`; an int with ``integer``), at least ``minimum``:
    ``default`` when unset or empty; anything else is an error naming the variable and the value."""
    if name not in ENV_VARS:
        raise GraphDSLError(f"env_number: {name!r} is not a graphdsl environment variable (graphdsl/env.py)")
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    kind = "an integer" if integer else "a number"
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not value >= minimum:
        raise GraphDSLError(f"{name} must be {kind} >= {minimum:g}, got {os.environ[name]!r}")
    return value


def unknown_env_vars(environ=None) -> list[tuple[str, str | None]]:
    """``(name, closest known name or None)`` for each set ``GRAPHDSL_*`` variable graphdsl does not
    read (``GRAPHDSL_TEST_*`` are the test suite's own)."""
    environ = os.environ if environ is None else environ
    out = []
    for name in sorted(environ):
        if name.startswith("GRAPHDSL_") and name not in ENV_VARS and not name.startswith("GRAPHDSL_TEST_"):
            tails = {k[len("GRAPHDSL_"):]: k for k in ENV_VARS}      # the shared prefix says nothing
            close = difflib.get_close_matches(name[len("GRAPHDSL_"):], list(tails), n=1, cutoff=0.7)
            out.append((name, tails[close[0]] if close else None))
    return out


_WARNED: set[str] = set()


def warn_unknown_env_vars(stacklevel: int = 2) -> None:
    """Warn (once a name, a process) of each set ``GRAPHDSL_*`` variable that nothing reads; the
    warning names the line ``stacklevel`` frames above this call (2: the caller's caller)."""
    import warnings
    for name, close in unknown_env_vars():
        if name not in _WARNED:
            _WARNED.add(name)
            hint = f"; did you mean {close}?" if close else ""
            warnings.warn(f"{name} is set, but graphdsl reads no such environment variable{hint} "
                          "(`graphdsl env` lists those it reads)", UserWarning, stacklevel=stacklevel + 1)
