"""runtime/precompile.py: the dry pass, the disk-cache lookup and the worker processes, on the CPU.

The compiling scenarios run in a process of their own (tests/helpers/precompile_scenarios.py: a
pytest process has Triton imported under the interpreter, whose kernels cannot be compiled); the
engine's use of them on a GPU (a first forward, logits unchanged) is tests/gpu/test_precompile_gpu.py's.
"""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime import precompile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton")), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.precompile_scenarios"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cold_cache_turns_the_forward_dry_and_a_worker_compiles_the_kernel(scenarios):
    assert scenarios["jit"]
    assert scenarios["cold"] == {"deferred": 1, "on_disk": 0, "compiled": 1, "failed": [], "workers": 1,
                                 "killed": 0, "dry_error": None}
    assert scenarios["cold_kernels"] == ["add_one"] and scenarios["cold_marks"] == ["dry"]
    assert scenarios["untouched"] and scenarios["in_history"]     # the dry part launched nothing


def test_what_a_worker_compiled_is_found_on_disk_by_another_import(scenarios):
    assert scenarios["lookup_same"] == [1, 0, []]           # recorded, not a miss
    assert scenarios["lookup_other"] == [1, 1, []]          # another BLOCK: a miss
    assert scenarios["on_disk"] == [True, False]            # the probe agrees, loading nothing


def test_a_compiled_kernel_is_not_launched_in_a_dry_pass(scenarios):
    # its inputs may be a skipped kernel's unwritten output: an H200 read out of bounds so
    assert scenarios["hit_not_launched"] == [0, None]
    assert scenarios["run_restored"] == "JITFunction.run"


def test_a_warm_cache_runs_the_forward_for_real_with_no_dry_pass(scenarios):
    # the kernel loaded from the disk and launched: with no GPU behind the offline driver, that raises
    assert "launcher_cls" in scenarios["warm"]
    assert scenarios["warm_quiet"] == [0, [], False, False]      # no report, never dry, nothing left on


def test_kernels_after_the_turn_are_recorded_and_those_on_disk_loaded(scenarios):
    assert scenarios["mixed"] == {"deferred": 2, "on_disk": 1, "compiled": 1, "failed": [], "workers": 1,
                                  "killed": 0, "dry_error": None}


def test_a_forward_inside_another_watch_runs_in_it_and_turns_with_it(scenarios):
    outer, inner, marks, still_dry = scenarios["nested"]
    assert (outer["deferred"], outer["compiled"], outer["failed"]) == (1, 1, [])
    assert inner == [None, None]                   # the outer watch reports; its caller reruns
    assert marks == ["outer", "inner", "inner2", "ran"]   # turned inside the first; the second already dry
    assert still_dry is False


def test_a_forward_that_fails_after_the_turn_still_compiles_what_it_recorded(scenarios):
    r = scenarios["failing"]
    assert r["dry_error"] == "RuntimeError: data-dependent host code"
    assert (r["deferred"], r["compiled"], r["failed"]) == (1, 1, [])
    assert scenarios["raises"] == ["division by zero", "failing"]    # raised before the turn: raised, no report


def test_workers_that_fail_die_or_hang_leave_their_kernels_to_the_forward(scenarios):
    assert scenarios["bad"] == {"fails": [False, "RuntimeError: no compiler today"],
                                "dies": [False, "worker exited"], "hangs": [False, "no answer in 2 s"]}
    assert scenarios["bad_killed"] == 1             # the hung one
    assert scenarios["bad_seconds"] < 15            # given up, not waited for


def test_workers_exit_on_their_own_when_their_tasks_are_done(scenarios):
    done, killed, seconds = scenarios["quick"]
    assert done == list(range(12)) and killed == 0
    assert seconds < 1.5        # (each held the others' pipes once, and waited 2 s apiece to be killed)


def test_a_kernel_from_a_source_file_compiles_by_its_path(scenarios):
    assert scenarios["generated"]["compiled"] == 1 and scenarios["generated"]["failed"] == []


def test_only_the_calling_threads_launches_are_deferred():
    pytest.importorskip("triton")

    class Fn:
        module, name, jit_function = "m", "k", None
    seen = []
    with precompile.defer_launches() as dry:
        t = threading.Thread(target=lambda: seen.append(dry._hook(key=0, repr="", fn=Fn, compile={},
                                                                  is_manual_warmup=False, already_compiled=False)))
        t.start()
        t.join()
    assert seen == [None] and dry.found == []


def test_the_backend_compiles_ahead_only_on_cuda(monkeypatch):
    from graphdsl.runtime.backends.triton_backend import TritonBackend
    assert TritonBackend().ahead_applies([], "cpu") is False
    monkeypatch.setenv("GRAPHDSL_COMPILE_WORKERS", "0")
    assert precompile.num_workers() == 0
    monkeypatch.setenv("GRAPHDSL_COMPILE_WORKERS", "many")
    with pytest.raises(GraphDSLError, match="GRAPHDSL_COMPILE_WORKERS must be an integer >= 0, got 'many'"):
        precompile.num_workers()
