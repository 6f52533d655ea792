"""``graphdsl serve --api-processes N``: the HTTP server in processes of its own, the engine in this one.

In one process the engine thread and the HTTP thread take turns on the interpreter lock: every
torch call of a step releases it, and taking it back waits while the HTTP thread writes its
streams. Under load that turn-taking, not the work, sets a small model's step time (docs/serving.md,
session 34). As in vLLM and SGLang, the HTTP side can run apart:

* this process keeps the model and the :class:`~.openai_server.AsyncEngine` (its engine thread),
  and one *bridge* thread per API process reading that process's pipe;
* each API process runs the same FastAPI app (:func:`~.openai_server.make_app`) on the shared
  listening socket, over a :class:`RemoteEngine`: it parses and checks requests, tokenizes
  prompts, applies chat templates and writes the streams.

The pipe carries pickled tuples. API process -> engine: ``("add", rid, ids, text, params, lora,
stream)``, ``("abort", rid)``, ``("call", qid, name)``. Engine -> API process: ``("items", [(rid,
item), ...])`` (one message an engine step and API process: ``("ok", request_id)`` or
``("refused", message)`` answer an add, then the request's deltas, result or error, as the handlers
of one process get them), ``("reply", qid, value)`` and ``("fatal", message)`` when the engine
stops. A request's prompt is checked by the model's own rules on the engine side
(``AsyncEngine.make_group``) before the handler answers, so a refused prompt is still a 400. An API
process that goes away has its requests aborted; an engine that stops fails every request and makes
``/health`` answer 500, as in one process.
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass

from graphdsl.errors import GraphDSLError

from .openai_server import AsyncEngine, _Tracked, make_app

__all__ = ["ApiProcesses", "RemoteEngine", "start_api_processes"]

_LAST = ("done", "error", "bad", "refused")      # items after which a request has nothing more


# -- the engine's side ----------------------------------------------------------------------------
class _PipeSink:
    """Where the engine thread's items for one API process go: one message a hand-over."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()           # the bridge thread and the engine thread both send
        self.live: dict[int, _Tracked] = {}    # rid -> the request, until its last item is sent

    def send(self, message) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):       # the API process is gone; the bridge aborts its requests
                pass

    def deliver(self, items: list) -> None:
        out = []
        for t, item in items:
            out.append((t.rid, item))
            if item[0] in _LAST:
                self.live.pop(t.rid, None)
        self.send(("items", out))


def _bridge(engine: AsyncEngine, conn) -> None:
    """Serve one API process's pipe until it closes (then abort what it still had running)."""
    sink = _PipeSink(conn)
    engine.on_stop.append(lambda message: sink.send(("fatal", message)))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            for t in list(sink.live.values()):
                engine.abort(t)
            return
        kind = message[0]
        if kind == "add":
            _, rid, ids, text, params, lora, stream = message
            try:
                group = engine.make_group(ids, text, params, lora)
            except GraphDSLError as e:
                sink.send(("items", [(rid, ("refused", str(e)))]))
                continue
            t = _Tracked(group, None, sink, stream, rid=rid)
            sink.live[rid] = t
            sink.send(("items", [(rid, ("ok", group.request_id))]))     # before any item of the request
            engine.submit_tracked(t)
        elif kind == "abort":
            t = sink.live.pop(message[1], None)
            if t is not None:
                engine.abort(t)
        elif kind == "call":
            _, qid, name = message
            value = engine.metrics_lines() if name == "metrics" else None
            sink.send(("reply", qid, value))


# -- the API process's side -----------------------------------------------------------------------
@dataclass
class _ModelInfo:
    """What an API process's handlers ask of the model before a request starts."""

    tokenizer: object
    max_model_len: int
    loras: list[str]

    def list_loras(self) -> list[str]:
        return list(self.loras)


@dataclass(eq=False)
class _RemoteTracked:
    """A request of this API process, as its handler sees it."""

    rid: int
    out: asyncio.Queue
    params: object
    lora: str | None
    request_id: str


class RemoteEngine:
    """An API process's view of the engine: the methods and attributes :func:`make_app` uses of an
    :class:`AsyncEngine`, over the pipe. Its reader thread hands each message to the event loop."""

    def __init__(self, conn):
        self.conn = conn
        self.error: str | None = None
        self._queues: dict[int, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._aloop: asyncio.AbstractEventLoop | None = None

    @property
    def error_message(self) -> str:
        return self.error or ""

    def _start(self) -> None:
        if self._aloop is None:
            self._aloop = asyncio.get_running_loop()
            threading.Thread(target=self._read, name="graphdsl-api-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._aloop.call_soon_threadsafe(self._engine_gone)
                return
            self._aloop.call_soon_threadsafe(self._dispatch, message)

    def _engine_gone(self) -> None:
        """The engine's process is gone: fail what is waiting, then stop serving (uvicorn's graceful
        shutdown on SIGTERM) rather than answer 500 for ever — both on the event loop, in that order,
        so no waiter resumes before the stop is asked for."""
        self._dispatch(("fatal", "the engine process is gone"))
        os.kill(os.getpid(), signal.SIGTERM)

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "items":
            queues = self._queues
            for rid, item in message[1]:
                q = queues.get(rid)
                if q is not None:
                    q.put_nowait(item)
                    if item[0] in _LAST:
                        del queues[rid]
        elif kind == "reply":
            fut = self._calls.pop(message[1], None)
            if fut is not None and not fut.done():
                fut.set_result(message[2])
        elif kind == "fatal":
            self.error = self.error or message[1]
            for q in self._queues.values():
                q.put_nowait(("error", self.error))
            self._queues.clear()
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(GraphDSLError(self.error))
            self._calls.clear()

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):
            self._dispatch(("fatal", "the engine process is gone"))

    async def open(self, ids, text, params, lora, stream: bool) -> _RemoteTracked:
        """Start a request; the engine refuses a prompt as ``LLM.generate`` would (GraphDSLError)."""
        self._start()
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        self._send(("add", rid, ids, text, params, lora, stream))
        try:
            first = await q.get()
        except asyncio.CancelledError:
            self._queues.pop(rid, None)
            self._send(("abort", rid))
            raise
        if first[0] == "refused":
            raise GraphDSLError(first[1])
        if first[0] != "ok":                   # the engine stopped: the handler answers 500
            self._queues.pop(rid, None)
            q.put_nowait(first)
            return _RemoteTracked(rid, q, params, lora, str(rid))
        return _RemoteTracked(rid, q, params, lora, first[1])

    def abort(self, tracked: _RemoteTracked) -> None:
        if self._queues.pop(tracked.rid, None) is not None:
            self._send(("abort", tracked.rid))

    async def metrics(self) -> list[str]:
        self._start()
        qid = next(self._ids)
        fut = self._aloop.create_future()
        self._calls[qid] = fut
        self._send(("call", qid, "metrics"))
        try:
            return await fut
        except GraphDSLError:
            return []


def _api_main(conn, info: _ModelInfo, sock, served_model_name: str, api_key: str | None) -> None:
    """An API process: the app over a :class:`RemoteEngine`, served on the shared socket."""
    import uvicorn
    app = make_app(info, RemoteEngine(conn), served_model_name=served_model_name, api_key=api_key)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


# -- starting them --------------------------------------------------------------------------------
@dataclass
class ApiProcesses:
    """The API processes of an engine and the engine (in this process)."""

    engine: AsyncEngine
    processes: list
    address: tuple                   # where they listen

    def wait_ready(self, seconds: float = 120.0) -> None:
        """Block until a connection to :attr:`address` is accepted (an API process imports torch
        and graphdsl before it listens: seconds)."""
        import socket
        import time
        deadline = time.monotonic() + seconds
        while True:
            if not any(p.is_alive() for p in self.processes):
                raise GraphDSLError(f"the API processes ended before listening (exit codes "
                                    f"{[p.exitcode for p in self.processes]}); see their messages above")
            try:
                socket.create_connection(self.address[:2], timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise GraphDSLError(f"no API process listened on {self.address[:2]} within {seconds:.0f} s") from None
                time.sleep(0.1)

    def wait(self) -> None:
        """Block until every API process has ended (Ctrl-C ends them)."""
        try:
            for p in self.processes:
                p.join()
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        """End the API processes: SIGTERM (uvicorn's graceful shutdown), SIGKILL after 10 s."""
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def start_api_processes(llm, count: int, sock, *, served_model_name: str,
                        api_key: str | None = None) -> ApiProcesses:
    """Start ``llm``'s engine thread here and ``count`` API processes serving on ``sock`` (a bound
    socket; each process listens on it). Returns once they are started, not once they listen."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise GraphDSLError(f"start_api_processes: count must be a positive integer, got {count!r}")
    engine = AsyncEngine(llm)
    info = _ModelInfo(llm.tokenizer, llm.max_model_len, llm.list_loras())
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for i in range(count):
        here, there = ctx.Pipe()
        p = ctx.Process(target=_api_main, args=(there, info, sock, served_model_name, api_key),
                        name=f"graphdsl-api-{i}", daemon=True)
        p.start()
        there.close()
        threading.Thread(target=_bridge, args=(engine, here), name=f"graphdsl-bridge-{i}", daemon=True).start()
        procs.append(p)
    print(f"graphdsl serve: {count} API process{'es' if count > 1 else ''} started "
          f"(pids {', '.join(str(p.pid) for p in procs)})", file=sys.stderr, flush=True)
    return ApiProcesses(engine, procs, sock.getsockname())
