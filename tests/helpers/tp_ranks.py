"""Run a function on W ranks as torchrun would (one spawned process per rank, torchrun's environment
variables set), collecting rank 0's result; or once in a fresh process (``in_fresh_process``), so that a
test's tensor-parallel ``LLM`` meets no process group or symmetric-memory buffers another test left.
Used by the tensor-parallel tests and the GPU tests."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (Linux; a zombie no one reaps counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def worker_outlives_killed_rank0(target, args: tuple, *, ready_s: float, gone_within_s: float) -> bool:
    """Start ``target(*args, pids)`` as rank 0 in a spawned process (it puts its worker's pid on
    ``pids``), SIGKILL it a second after that pid arrives, and say whether the worker is still
    alive ``gone_within_s`` later (a stray worker is then killed)."""
    import signal
    import time
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    rank0 = ctx.Process(target=target, args=(*args, pids))
    rank0.start()
    worker = None
    try:
        worker = pids.get(timeout=ready_s)
        time.sleep(1.0)                              # the worker is running (loading, or steps in flight)
        assert not process_gone(worker), "the worker died before its rank 0 was killed"
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.join(10)
        deadline = time.monotonic() + gone_within_s
        while not process_gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not process_gone(worker)
    finally:
        if rank0.is_alive():
            rank0.kill()
        if worker is not None and not process_gone(worker):
            os.kill(worker, signal.SIGKILL)


def _rank_main(rank: int, world_size: int, port: int, fn, args, results, timeout_s: float) -> None:
    import faulthandler
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 5), exit=True)   # a hung rank shows where
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        torch.set_num_threads(1)
        out = fn(rank, world_size, *args)
        import gc
        gc.collect()    # LLMs fn dropped close their groups now (a torchrun script would at exit)
        results.put((rank, "ok", pickle.dumps(out)))     # plain bytes: no shared-memory handles to outlive us
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(world_size: int, fn, *args, timeout_s: float = 240.0):
    """``fn(rank, world_size, *args)`` on every rank under torchrun's environment; returns rank 0's
    value. Raises with the traceback of any rank that failed, or when a rank does not finish."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results, timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout_s)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
    return got[0]


def _fresh_main(fn, args, env, results, timeout_s: float) -> None:
    import faulthandler
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 5), exit=True)   # a hang shows where
    os.environ.update(env)
    try:
        results.put(("ok", pickle.dumps(fn(*args))))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def in_fresh_process(fn, *args, env: dict | None = None, timeout_s: float = 240.0):
    """``fn(*args)`` in a spawned process with ``env`` added to its environment; returns its value,
    raises with its traceback if it failed, or when it gave nothing within ``timeout_s``. A process that
    does not exit within a minute of answering is killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_fresh_main, args=(fn, args, dict(env or {}), results, timeout_s), daemon=False)
    p.start()
    try:
        status, value = results.get(timeout=timeout_s)
    except Exception:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} gave no result within {timeout_s:.0f}s") from None
    finally:
        p.join(60.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
    if status != "ok":
        raise AssertionError(f"{getattr(fn, '__name__', fn)} failed in its process:\n{value}")
    return pickle.loads(value)
