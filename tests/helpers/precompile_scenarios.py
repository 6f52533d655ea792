"""Scenarios of runtime/precompile.py on the CPU, run in a process of their own by
tests/kernels/test_precompile.py (a pytest process imports Triton under ``TRITON_INTERPRET=1``,
and Triton's compiled path cannot run in a process that has).

    python -m tests.helpers.precompile_scenarios     # TRITON_CACHE_DIR: an empty directory

Triton compiles for an sm_90 target without a GPU (only its compiler and ``ptxas`` run): Triton's
driver is replaced by ``precompile.OfflineDriver``, as the workers do, and the test kernel, a
compiled ``JITFunction``, is launched on CPU tensors, which the dry pass turns into a recorded
specialisation instead of a launch. Prints one JSON object: each scenario's findings.
"""
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

KERNELS = "tests.helpers.precompile_kernels"


def _fresh():
    """The test kernel's module imported afresh: a JITFunction with an empty in-memory cache."""
    sys.modules.pop(KERNELS, None)
    return importlib.import_module(KERNELS)


def _report(r) -> dict:
    return {"deferred": r.deferred, "on_disk": r.on_disk, "compiled": r.compiled, "failed": r.failed,
            "workers": r.workers, "killed": r.killed, "dry_error": r.dry_error}


def main() -> int:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from graphdsl.runtime import precompile
    driver.set_active(precompile.OfflineDriver(GPUTarget("cuda", 90, 32)))
    out = {}
    kernels = _fresh()
    out["jit"] = isinstance(kernels.add_one, JITFunction)
    x = torch.zeros(64)

    # 1. a cold cache: the watched forward turns dry at its first launch, which is skipped; a worker
    # compiles the kernel
    marks = []
    r = precompile.run_ahead(lambda: kernels.add_one[(1,)](x, 60, BLOCK=64), "cold",
                             on_dry=lambda: marks.append("dry"), workers=2)
    out["cold"] = _report(r)
    out["cold_kernels"] = r.kernels
    out["cold_marks"] = marks
    out["untouched"] = bool(torch.equal(x, torch.zeros(64)))
    out["in_history"] = precompile.history[-1] is r

    # 2. a process that never compiled it finds it on disk; another specialisation is not there
    again = _fresh()
    with precompile.defer_launches() as dry:
        again.add_one[(1,)](x, 60, BLOCK=64)
    out["on_disk"] = [precompile.on_disk(d) for d in dry.found]
    misses, failed = precompile.load_cached(dry.found)
    out["lookup_same"] = [len(dry.found), len(misses), failed]
    with precompile.defer_launches() as dry:
        again.add_one[(1,)](x, 60, BLOCK=128)
    out["on_disk"] += [precompile.on_disk(d) for d in dry.found]
    misses, failed = precompile.load_cached(dry.found)
    out["lookup_other"] = [len(dry.found), len(misses), failed]

    # 2b. a specialisation this process has compiled is not launched in a dry pass either (a launch
    # here, with no GPU behind the offline driver, raises)
    try:
        with precompile.defer_launches() as dry:
            again.add_one[(1,)](x, 60, BLOCK=64)
        out["hit_not_launched"] = [len(dry.found), None]
    except Exception as e:
        out["hit_not_launched"] = [None, f"{type(e).__name__}: {e}"[:200]]
    out["run_restored"] = JITFunction.run.__qualname__

    # 3. everything on disk: the watched forward never turns dry; Triton loads the kernel and launches
    # it (which, with no GPU behind the offline driver, raises: the launch was the real one)
    before, marks = len(precompile.history), []
    try:
        precompile.run_ahead(lambda: _fresh().add_one[(1,)](x, 60, BLOCK=64), "warm",
                             on_dry=lambda: marks.append("dry"), workers=2)
        out["warm"] = "no launch"
    except Exception as e:
        out["warm"] = f"{type(e).__name__}: {e}"[:200]
    out["warm_quiet"] = [len(precompile.history) - before, marks, precompile.watching(),
                         precompile.dry_pass_running()]

    # 3a. a kernel missing from the disk first, then one on it: both recorded after the turn; the
    # second is loaded from the disk, the first compiled by a worker
    fresh = _fresh()
    r = precompile.run_ahead(lambda: (fresh.add_one[(1,)](x, 60, BLOCK=256), fresh.add_one[(1,)](x, 60, BLOCK=64)),
                             "mixed", workers=2)
    out["mixed"] = _report(r)

    # 3b. forwards inside another's watch (a graph runner's step meeting a new plan): they run in it,
    # and their on_dry is called when it turns dry during them, or at once if it already has
    marks, inner = [], []

    def forward():
        inner.append(precompile.run_ahead(lambda: kernels.add_one[(1,)](x, 64, BLOCK=512), "inner",
                                          on_dry=lambda: marks.append("inner"), workers=2))
        inner.append(precompile.run_ahead(lambda: marks.append("ran"), "inner2", on_dry=lambda: marks.append("inner2"),
                                          workers=2))
    outer = precompile.run_ahead(forward, "outer", on_dry=lambda: marks.append("outer"), workers=2)
    out["nested"] = [_report(outer), inner, marks, precompile.dry_pass_running()]

    # 4. a forward that raises after turning dry keeps what it recorded; one that raises before, raises
    def failing():
        kernels.add_one[(1,)](x, 64, BLOCK=32)
        raise RuntimeError("data-dependent host code")
    out["failing"] = _report(precompile.run_ahead(failing, "failing", workers=2))
    try:
        precompile.run_ahead(lambda: 1 / 0, "raises", workers=2)
        out["raises"] = None
    except ZeroDivisionError as e:
        out["raises"] = [str(e), precompile.history[-1].label]

    # 5. workers that fail, die or hang leave their kernels to the forward
    class Fails:
        def preload(self, spec):
            raise RuntimeError("no compiler today")

    class Dies:
        def preload(self, spec):
            os._exit(3)

    class Hangs:
        def preload(self, spec):
            time.sleep(30)
    precompile.TASK_TIMEOUT_S = 2.0
    bad = [precompile.Deferred("m", name, "{}", jit) for name, jit in
           (("fails", Fails()), ("dies", Dies()), ("hangs", Hangs()))]
    t0 = time.perf_counter()
    replies, killed = precompile._run_workers(bad, 3, GPUTarget("cuda", 90, 32))
    out["bad"] = {d.qualname: [replies[i]["ok"], replies[i]["error"]] for i, d in enumerate(bad)}
    out["bad_killed"] = killed
    out["bad_seconds"] = time.perf_counter() - t0

    # 5b. workers whose tasks are done exit at once, each on its own (none holds another's pipe)
    class Quick:
        def preload(self, spec):
            return None
    t0 = time.perf_counter()
    replies, killed = precompile._run_workers([precompile.Deferred("m", f"q{i}", "{}", Quick()) for i in range(12)],
                                              6, GPUTarget("cuda", 90, 32))
    out["quick"] = [sorted(i for i, r in replies.items() if r["ok"]), killed, time.perf_counter() - t0]

    # 6. a kernel in a module loaded from a file (generated kernels): the worker loads it by path
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "pc_generated_kernel.py")
        with open(kernels.__file__) as f, open(path, "w") as g:
            g.write(f.read())
        spec = importlib.util.spec_from_file_location("graphdsl_fused_pctest", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out["generated"] = _report(precompile.run_ahead(lambda: mod.add_one[(1,)](x, 64, BLOCK=16),
                                                            "generated", workers=2))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
