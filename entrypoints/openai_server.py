"""``graphdsl serve``: an OpenAI-compatible HTTP server over the serving loop.

One engine thread owns a long-lived :class:`~graphdsl.runtime.serving.scheduler.Scheduler` and
:class:`~graphdsl.runtime.serving.loop.ServingLoop`; HTTP handlers (FastAPI on uvicorn, one
asyncio loop) hand it requests through a thread-safe queue and receive per-token deltas through
asyncio queues. Every request joins the same continuous batch; nothing serialises generation.
The deltas of one engine step reach the asyncio loop in one ``call_soon_threadsafe`` (each such
call wakes the loop through a socket write), and a stream sends every delta waiting in its queue
as one write; a request that does not stream gets its result alone. A client that disconnects
aborts its request, whose KV blocks go back to the pool at the engine's next step. Text, stop
strings and logprobs are handled by the same code as ``LLM.generate`` (``LLM._accept`` /
``LLM._output``). With ``graphdsl serve --api-processes N`` the same app runs in N processes of its
own over a client of the engine thread (:mod:`.api_processes`); the handlers use only what both
give (:func:`make_app`).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream`` as server-sent events ending in ``data: [DONE]``),
``GET /metrics`` (Prometheus text). Errors, routing ones included, have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``. Each endpoint takes a closed set of fields:
OpenAI's it implements, vLLM's extra sampling fields, and OpenAI's unimplemented ones only at the
value that asks for nothing; anything else is a 400 naming the field (docs/serving.md lists them).

A request's ``n`` samples finish in any order and a step may end several at once: the request is
done when each sample's last event has been handled. An exception while adding a request fails that
request; one while stepping stops the engine (traceback on stderr, every request and ``/health``
answer 500 from then on).
"""

import asyncio
import bisect
import itertools
import json
import queue
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from graphdsl.errors import GraphDSLError
from graphdsl.entrypoints.llm import chat_messages
from graphdsl.runtime.serving.loop import ServingLoop
from graphdsl.runtime.serving.sampling import SamplingParams
from graphdsl.runtime.serving.scheduler import RequestStatus

__all__ = ["AsyncEngine", "build_app", "make_app", "ApiError"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ApiError(Exception):
    """An error answered in OpenAI's shape with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- the engine thread -------------------------------------------------------------------------
@dataclass(eq=False)
class _Tracked:
    """A request the engine thread is running: its prompt group and where its deltas go (``sink``:
    an asyncio loop of this process, or the pipe to an API process, :mod:`.api_processes`)."""

    group: Any                     # entrypoints.llm._Prompt
    out: asyncio.Queue | None      # the handler's queue (None: the request of an API process)
    sink: Any                      # has deliver([(tracked, item), ...]), called from the engine thread
    stream: bool = True            # deltas wanted (False: only the result, as one response)
    rid: int | None = None         # the API process's number for the request
    sent: dict = field(default_factory=dict)     # sample index -> characters of text sent
    finished: set = field(default_factory=set)   # indexes of the samples whose last event was handled
    start: float = field(default_factory=time.monotonic)
    last: float | None = None
    hold: int = field(init=False)  # characters of streamed text held back while a stop string may be forming

    def __post_init__(self):
        self.hold = max((len(x) for x in self.group.params.stop), default=1) - 1

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def lora(self) -> str | None:
        return self.group.lora

    @property
    def request_id(self) -> str:
        return self.group.request_id


class _LoopSink:
    """Hands items to the handlers' queues on an asyncio loop of this process: one
    ``call_soon_threadsafe`` a batch (each wakes the loop through a socket write)."""

    def __init__(self, aloop):
        self.aloop = aloop

    def deliver(self, items: list) -> None:
        self.aloop.call_soon_threadsafe(_put_all, [(t.out, item) for t, item in items])


class _Histogram:
    """A Prometheus histogram: observations counted in the first bucket whose bound holds them
    (one bisection a token), made cumulative when printed."""

    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * (len(buckets) + 1), 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.n += 1
        self.counts[bisect.bisect_left(self.buckets, v)] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, itertools.accumulate(self.counts))]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum}", f"{name}_count {self.n}"]


class AsyncEngine:
    """Runs ``llm``'s model for many concurrent requests from one background thread."""

    def __init__(self, llm):
        self.llm = llm
        self.sched = llm._scheduler()
        tok = llm.tokenizer
        self.loop = ServingLoop(llm._executor, self.sched, overlap=llm.overlap,
                                logprob_decoder=(lambda t: tok.decode([t], skip_special_tokens=False)) if tok else None)
        self._commands: queue.Queue = queue.Queue()
        self._by_req: dict[int, tuple[_Tracked, Any]] = {}
        self._ids = itertools.count()
        self.generated_tokens = 0
        self.finished_requests = 0
        self.ttft, self.itl = _Histogram(_TTFT_BUCKETS), _Histogram(_ITL_BUCKETS)
        self.max_running_seen = 0
        self.error: BaseException | None = None
        self._outbox: list[tuple[_Tracked, tuple]] = []   # items for the handlers, sent by _flush
        self._sinks: dict[Any, _LoopSink] = {}             # asyncio loop -> its sink
        self.on_stop: list = []            # fn(message) called when the engine stops (API processes' bridges)
        import torch                       # (API processes import this module without torch)
        device = llm.device                # the thread steps on the LLM's GPU (each thread has its own current one)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._thread = threading.Thread(target=self._run, name="graphdsl-engine", daemon=True)
        self._thread.start()

    # called from the asyncio side
    def submit(self, group, aloop: asyncio.AbstractEventLoop, stream: bool = True) -> _Tracked:
        sink = self._sinks.get(aloop)
        if sink is None:
            sink = self._sinks[aloop] = _LoopSink(aloop)
        return self.submit_tracked(_Tracked(group, asyncio.Queue(), sink, stream))

    def submit_tracked(self, t: _Tracked) -> _Tracked:
        """Hand ``t`` to the engine thread (any thread may call this)."""
        self._commands.put(("add", t))
        if self.error is not None:          # the engine stopped meanwhile: nobody will take the command
            t.sink.deliver([(t, ("error", self.error_message))])
        return t

    def make_group(self, ids: list[int], text: str | None, params: SamplingParams, lora: str | None):
        """The prompt group of a request (any thread); a prompt or a setting the model refuses
        raises :class:`GraphDSLError`, as ``LLM.generate`` would."""
        group = self.llm._make_prompts([ids], params, False)[0]
        group.prompt, group.lora = text, lora
        return group

    async def open(self, ids: list[int], text: str | None, params: SamplingParams, lora: str | None,
                   stream: bool) -> _Tracked:
        """Start a request of prompt ``ids`` from a handler on the running loop (nothing is started
        when :meth:`make_group` refuses it)."""
        return self.submit(self.make_group(ids, text, params, lora), asyncio.get_running_loop(), stream=stream)

    def metrics_lines(self) -> list[str]:
        """``/metrics``' Prometheus text, a line an item."""
        st = self.stats()
        lines = ["# TYPE graphdsl_requests_running gauge", f"graphdsl_requests_running {st['running']}",
                 "# TYPE graphdsl_requests_waiting gauge", f"graphdsl_requests_waiting {st['waiting']}",
                 "# TYPE graphdsl_kv_cache_usage_ratio gauge", f"graphdsl_kv_cache_usage_ratio {st['kv_usage']:.4f}",
                 "# TYPE graphdsl_generated_tokens_total counter",
                 f"graphdsl_generated_tokens_total {self.generated_tokens}",
                 "# TYPE graphdsl_requests_finished_total counter",
                 f"graphdsl_requests_finished_total {self.finished_requests}"]
        return lines + self.ttft.lines("graphdsl_time_to_first_token_seconds") + \
            self.itl.lines("graphdsl_inter_token_latency_seconds")

    async def metrics(self) -> list[str]:
        return self.metrics_lines()

    def abort(self, tracked: _Tracked) -> None:
        self._commands.put(("abort", tracked))

    @property
    def error_message(self) -> str:
        e = self.error
        return f"the engine stopped: {type(e).__name__}: {e}"

    def stats(self) -> dict:
        blocks = self.llm.blocks
        return {"running": len(self.sched.running), "waiting": len(self.sched.waiting),
                "kv_usage": 1.0 - blocks.num_free_blocks / blocks.num_blocks}

    # the engine thread
    def _run(self) -> None:
        try:
            if self._device.type == "cuda":
                import torch
                torch.cuda.set_device(self._device)
            while True:
                idle = not self.loop.has_work()
                try:
                    cmd = self._commands.get(block=idle, timeout=None)
                    self._do(cmd)
                    while True:
                        self._do(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self.loop.has_work():
                    self.max_running_seen = max(self.max_running_seen, len(self.sched.running))
                    for ev in self.loop.step():
                        self._event(ev)
                    if self._by_req and not self.loop.has_work():
                        self._settle()
                self._flush()
        except BaseException as e:  # noqa: BLE001 - logged, reported to every waiting request, then the thread ends
            self._stop(e)

    def _stop(self, e: BaseException) -> None:
        """The engine cannot go on (an exception while stepping): say so on stderr with the
        traceback, fail every request it holds or was handed, and give their KV blocks back."""
        self.error = e
        print(f"graphdsl serve: the engine thread stopped on {type(e).__name__}: {e}; every request fails with "
              "500 and /health answers 500 from now on (restart the server)", file=sys.stderr, flush=True)
        traceback.print_exception(e, file=sys.stderr)
        for fn in self.on_stop:
            fn(self.error_message)
        held = {id(t): t for t, _ in self._by_req.values()}
        while True:
            try:
                kind, t = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                held[id(t)] = t
        for t in held.values():
            self._post(t, ("error", self.error_message))
            try:
                self._do(("abort", t))
            except Exception:  # noqa: BLE001 - the scheduler may be what broke; the error is already reported
                pass
        self._flush()

    def _post(self, t: _Tracked, item: tuple) -> None:
        """Queue ``item`` for ``t``'s stream; :meth:`_flush` hands it over."""
        self._outbox.append((t, item))

    def _flush(self) -> None:
        """Hand the queued items to their sinks, in order: one hand-over a sink (an asyncio loop's
        wake-up, or one message to an API process), not one an item."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_sink: dict[Any, list] = {}
        for t, item in items:
            by_sink.setdefault(t.sink, []).append((t, item))
        for sink, batch in by_sink.items():
            sink.deliver(batch)

    def _do(self, cmd) -> None:
        kind, t = cmd
        if kind == "add":
            try:
                self._add(t)
            except GraphDSLError as e:           # e.g. more KV blocks than the pool has: the request's fault
                self._do(("abort", t))
                self._post(t, ("bad", str(e)))
            except Exception as e:  # noqa: BLE001 - a bug met while adding this request fails it alone
                print(f"graphdsl serve: request {t.group.request_id} failed while being added; the engine "
                      "keeps serving:", file=sys.stderr, flush=True)
                traceback.print_exception(e, file=sys.stderr)
                self._do(("abort", t))
                self._post(t, ("error", f"{type(e).__name__}: {e}"))
        elif kind == "abort":
            for s in t.group.samples:
                if s.req is not None and s.req.status is not RequestStatus.FINISHED:
                    self.sched.finish(s.req, "abort")
                if s.req is not None:
                    self._by_req.pop(id(s.req), None)

    def _add(self, t: _Tracked) -> None:
        for s in t.group.add_to(self.sched):
            self._by_req[id(s.req)] = (t, s)

    def _event(self, ev) -> None:
        entry = self._by_req.get(id(ev.request))
        if entry is None:
            return
        t, s = entry
        llm = self.llm
        llm._accept(self.sched, s, ev)
        now = time.monotonic()
        if t.last is None:
            self.ttft.observe(now - t.start)
        else:
            self.itl.observe(now - t.last)
        t.last = now
        self.generated_tokens += 1
        last = ev.finished or s.req.status is RequestStatus.FINISHED    # the last token, or a stop string ended it
        self._deliver(t, s, ev.token_id, ev.logprobs, last)

    def _deliver(self, t: _Tracked, s, token: int | None, logprobs, last: bool) -> None:
        """Send sample ``s``'s new text (held back while a stop string may be forming) to a stream;
        on its last event mark it finished, and once every sample of the request is, send the
        result."""
        llm = self.llm
        if t.stream:
            text = llm._text(s) if last else s.text
            end = len(text) if last else len(text) - t.hold
            sent = t.sent.get(s.index, 0)
            delta = ""
            if end > sent:
                delta, t.sent[s.index] = text[sent:end], end
            finish = (s.req.finish_reason or "length") if last else None
            self._post(t, ("delta", s.index, delta, token, logprobs, finish))
        if not last:
            return
        self._by_req.pop(id(s.req), None)
        t.finished.add(s.index)
        if len(t.finished) == len(t.group.samples):
            self.finished_requests += 1
            self._post(t, ("done", llm._output(t.group)))

    def _settle(self) -> None:
        """The loop is idle, so no event will come for the samples still tracked (their requests
        ended without a last event): finish them with what they have rather than leave clients waiting."""
        for t, s in list(self._by_req.values()):
            if s.req.status is RequestStatus.FINISHED:
                self._deliver(t, s, None, None, True)


def _put_all(batch: list[tuple[asyncio.Queue, tuple]]) -> None:
    """On the asyncio loop: put each item in its queue."""
    for q, item in batch:
        q.put_nowait(item)


# -- request parsing ---------------------------------------------------------------------------
MAX_N = 128                  # the most samples one request may ask for (OpenAI's limit)
_DEFAULT_COMPLETION_TOKENS = 16    # /v1/completions without max_tokens (OpenAI's legacy default, vLLM's too)

# SamplingParams fields a request sets under the same name (the vLLM extras among them).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "n", "ignore_eos", "min_tokens", "stop_token_ids")
_COMMON_FIELDS = ("model", "max_tokens", "stop", "stream", "stream_options", "logprobs", "user", *_SAMPLING_FIELDS)
_FIELDS = {False: frozenset((*_COMMON_FIELDS, "prompt")),
           True: frozenset((*_COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs"))}

# OpenAI fields this server does not implement, taken only at the value that asks for nothing:
# name -> (is the value neutral, given the body?; what to send instead).
_UNSUPPORTED = {
    "echo": (lambda v, b: not v, "the prompt is not echoed back; send false or leave it out"),
    "best_of": (lambda v, b: v is None or v == (b.get("n") or 1),
                "ask for n samples instead (best_of may only equal n)"),
    "suffix": (lambda v, b: not v, "there is no insertion mode; leave it out"),
    "logit_bias": (lambda v, b: not v, "send an empty object or leave it out"),
    "response_format": (lambda v, b: v is None or v == {"type": "text"},
                        "only free text is generated; send {\"type\": \"text\"} or leave it out"),
    "tools": (lambda v, b: not v, "there are no tool calls; leave it out"),
    "tool_choice": (lambda v, b: v is None or v == "none", "there are no tool calls; send \"none\" or leave it out"),
    "functions": (lambda v, b: not v, "there are no function calls; leave it out"),
    "function_call": (lambda v, b: v is None or v == "none",
                      "there are no function calls; send \"none\" or leave it out"),
    "parallel_tool_calls": (lambda v, b: v is None or not b.get("tools"), "there are no tool calls; leave it out"),
    "store": (lambda v, b: not v, "completions are not stored; send false or leave it out"),
    "metadata": (lambda v, b: not v or not b.get("store"), "completions are not stored; leave it out"),
    "service_tier": (lambda v, b: v in (None, "auto", "default"), "there is one tier; send \"auto\" or leave it out"),
    "modalities": (lambda v, b: v in (None, ["text"]), "only text is generated; send [\"text\"] or leave it out"),
    "audio": (lambda v, b: v is None, "only text is generated; leave it out"),
    "prediction": (lambda v, b: v is None, "there are no predicted outputs; leave it out"),
    "reasoning_effort": (lambda v, b: v is None, "the model's reasoning is not configurable; leave it out"),
    "web_search_options": (lambda v, b: v is None, "there is no web search; leave it out"),
}
_UNSUPPORTED_IN = {False: ("echo", "best_of", "suffix", "logit_bias"),
                   True: ("logit_bias", "response_format", "tools", "tool_choice", "functions", "function_call",
                          "parallel_tool_calls", "store", "metadata", "service_tier", "modalities", "audio",
                          "prediction", "reasoning_effort", "web_search_options")}

# Type checks made before SamplingParams (whose messages speak of its fields, not the request's).
_INT, _BOOL, _STR = "an integer", "true or false", "a string"
_TYPES = {False: {"stream": _BOOL, "n": _INT, "max_tokens": _INT, "min_tokens": _INT, "seed": _INT,
                  "best_of": _INT, "echo": _BOOL, "user": _STR},
          True: {"stream": _BOOL, "n": _INT, "max_tokens": _INT, "max_completion_tokens": _INT, "min_tokens": _INT,
                 "seed": _INT, "logprobs": _BOOL, "top_logprobs": _INT, "user": _STR}}
_IS = {_INT: lambda v: isinstance(v, int) and not isinstance(v, bool), _BOOL: lambda v: isinstance(v, bool),
       _STR: lambda v: isinstance(v, str)}


def _param_name(message: str) -> str | None:
    m = re.search(r"(?:invalid SamplingParams: |unknown field ')(\w+)", message)
    return m.group(1) if m else None


def _max_tokens_field(body: dict, chat: bool) -> str:
    """The field that sets the request's token budget: chat's ``max_completion_tokens`` wins over
    ``max_tokens`` when both are sent."""
    return "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"


def _sampling(body: dict, *, chat: bool, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The request's SamplingParams. Without a token budget, completions get 16 tokens and chat what
    the context has room for (``max_model_len`` - prompt), as vLLM."""
    kw: dict[str, Any] = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    budget = _max_tokens_field(body, chat)
    room = max(max_model_len - prompt_len, 1)       # a prompt that leaves no room is refused after this
    kw["max_tokens"] = body.get(budget)
    if kw["max_tokens"] is None:
        kw["max_tokens"] = room if chat else min(_DEFAULT_COMPLETION_TOKENS, room)
    stop = body.get("stop")
    if stop is not None:
        kw["stop"] = [stop] if isinstance(stop, str) else stop
    if chat:
        if body.get("logprobs"):
            kw["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    elif body.get("logprobs") is not None:
        kw["logprobs"] = body["logprobs"]
    if "top_k" in kw and kw["top_k"] == -1:
        kw["top_k"] = 0
    try:
        return SamplingParams(**kw)
    except GraphDSLError as e:
        # name the fields as the client sent them
        sent_as = {"max_tokens": budget, "logprobs": "top_logprobs" if chat else "logprobs"}
        message = str(e).replace("invalid SamplingParams: ", "")
        for ours, theirs in sent_as.items():
            message = re.sub(rf"(?<!top )\b{ours}\b", theirs, message)     # not "(top logprobs per ...)"
        message = re.sub(r"\bNone\b", "null", message)                  # in the client's JSON words
        name = _param_name(str(e))
        raise ApiError(400, message, sent_as.get(name, name)) from None


def _check_room(body: dict, chat: bool, prompt_len: int, params: SamplingParams, max_model_len: int) -> None:
    """Refuse a token budget the context cannot hold (vLLM does too) rather than cut it short."""
    if prompt_len + params.max_tokens > max_model_len:
        raise ApiError(400, f"max_model_len is {max_model_len}; this request asks {prompt_len + params.max_tokens} "
                            f"tokens ({prompt_len} prompt + {params.max_tokens} completion); lower "
                            f"{_max_tokens_field(body, chat)} to at most {max_model_len - prompt_len} or shorten "
                            f"the {'messages' if chat else 'prompt'}", _max_tokens_field(body, chat))


def _refused(message: str, chat: bool) -> ApiError:
    """The 400 for a request the model refuses (``LLM._make_prompts``' message), naming the field as
    the client sent it rather than as ``LLM.generate`` takes it."""
    if message.startswith("sampling_params.stop_token_ids"):
        return ApiError(400, message.removeprefix("sampling_params."), "stop_token_ids")
    what = "the prompt the chat template makes of messages" if chat else "the prompt"
    return ApiError(400, re.sub(r"^prompt 0\b", what, message), "messages" if chat else "prompt")


def _check_body(body: Any, chat: bool) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in _FIELDS[chat] and name not in _UNSUPPORTED_IN[chat]:
            raise ApiError(400, f"unknown field {name!r}; allowed fields: {sorted(_FIELDS[chat])}", name)
    for name, allowed in _TYPES[chat].items():
        v = body.get(name)
        if v is not None and not _IS[allowed](v):
            raise ApiError(400, f"{name} must be {allowed}, got {json.dumps(v)[:120]}", name)
    for name in _UNSUPPORTED_IN[chat]:
        neutral, instead = _UNSUPPORTED[name]
        if name in body and not neutral(body[name], body):
            raise ApiError(400, f"unsupported field {name!r} (got {json.dumps(body[name])[:120]}): {instead}", name)
    n = body.get("n")
    if n is not None and not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    _check_stream_options(body.get("stream_options"), body.get("stream"))
    return body


_STREAM_OPTIONS = {"include_usage": "the usage object in a last chunk", "include_obfuscation": "ignored"}


def _check_stream_options(opts, stream) -> None:
    """``stream_options`` as OpenAI takes it: an object of booleans ``include_usage`` and
    ``include_obfuscation`` (its padding field is not sent; the chunks' content is the same), only
    with ``stream: true`` (as vLLM). vLLM's ``continuous_usage_stats`` is not implemented."""
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise ApiError(400, f"stream_options must be an object like {{\"include_usage\": true}}, got {opts!r}",
                       "stream_options")
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    for key, v in opts.items():
        if key not in _STREAM_OPTIONS:
            raise ApiError(400, f"unknown field stream_options.{key}; allowed: {sorted(_STREAM_OPTIONS)}",
                           f"stream_options.{key}")
        if not isinstance(v, bool):
            raise ApiError(400, f"stream_options.{key} must be a boolean, got {v!r}", f"stream_options.{key}")


# -- response shapes -------------------------------------------------------------------------
def _chosen_logprobs(token_ids: list[int], positions: list, top: int, chat: bool, offset: int = 0) -> dict:
    """Logprobs of the chosen tokens (chat: ``content``; completions: the legacy four lists, whose
    ``text_offset`` counts characters from the completion's start: ``offset`` is the first token's)."""
    entries = []
    for t, pos in zip(token_ids, positions):
        lp = pos[t]
        others = sorted(pos.items(), key=lambda kv: kv[1].rank)[:top]
        entries.append((t, lp, others))
    if chat:
        return {"content": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                             "bytes": list((lp.decoded_token or "").encode()),
                             "top_logprobs": [{"token": o.decoded_token or "", "logprob": o.logprob,
                                               "bytes": list((o.decoded_token or "").encode())} for _, o in others]}
                            for t, lp, others in entries]}
    return {"tokens": [lp.decoded_token or "" for _, lp, _ in entries],
            "token_logprobs": [lp.logprob for _, lp, _ in entries],
            "top_logprobs": [{(o.decoded_token or str(i)): o.logprob for i, o in others} for _, _, others in entries],
            "text_offset": list(itertools.accumulate([len(lp.decoded_token or "") for _, lp, _ in entries[:-1]],
                                                     initial=offset))}


def _choice_json(index: int, delta: str, chat: bool, role: bool, logprobs, finish_reason) -> str:
    """One streamed choice as ``json.dumps`` writes it (``role``: the chat delta also says
    ``"role": "assistant"``). A token without logprobs that is not the last (most of them) is
    formatted around its encoded text, at a third of the cost of encoding the whole dict."""
    if logprobs is None and finish_reason is None:
        text = json.dumps(delta)
        if chat:
            d = f'{{"content": {text}, "role": "assistant"}}' if role else f'{{"content": {text}}}'
            return f'{{"index": {index}, "delta": {d}, "logprobs": null, "finish_reason": null}}'
        return f'{{"index": {index}, "text": {text}, "logprobs": null, "finish_reason": null}}'
    if chat:
        d = {"content": delta, "role": "assistant"} if role else {"content": delta}
        return json.dumps({"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish_reason})
    return json.dumps({"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason})


def _usage(result) -> dict:
    p = len(result.prompt_token_ids)
    c = sum(len(o.token_ids) for o in result.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# -- the app -------------------------------------------------------------------------------------
def build_app(llm, *, served_model_name: str, api_key: str | None = None):
    """The FastAPI application serving ``llm`` under ``served_model_name``, its engine thread in
    this process (``app.state.engine``)."""
    return make_app(llm, AsyncEngine(llm), served_model_name=served_model_name, api_key=api_key)


def make_app(llm, engine, *, served_model_name: str, api_key: str | None = None):
    """The FastAPI application over ``engine``: an :class:`AsyncEngine` in this process, or an API
    process's client of one (:class:`~graphdsl.entrypoints.api_processes.RemoteEngine`). ``llm``
    answers what the handlers ask of the model before a request starts: ``tokenizer``,
    ``max_model_len`` and ``list_loras()`` (an ``LLM``, or an API process's snapshot of them)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="graphdsl", docs_url=None, redoc_url=None)
    app.state.engine = engine
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        """Routing errors (no such path, wrong method) in OpenAI's shape too."""
        what = {404: f"there is no endpoint {request.method} {request.url.path}",
                405: f"{request.url.path} does not take {request.method}"}.get(e.status_code, str(e.detail))
        routes = "GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics"
        err = ApiError(e.status_code, f"{what}; this server serves {routes}")
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _any_error(request, e: Exception):
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    def _auth(request: Request) -> None:
        if api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key (send the header 'Authorization: Bearer <key>')",
                           kind="authentication_error", code="invalid_api_key")

    async def _body(request: Request, chat: bool) -> dict:
        try:
            return _check_body(await request.json(), chat)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None

    def _model(body: dict) -> str | None:
        """The LoRA adapter the request's ``model`` names (None: the base model)."""
        name, served = body.get("model"), [served_model_name, *llm.list_loras()]
        if name is None:
            raise ApiError(400, f"model is required; this server serves {served}", "model")
        if not isinstance(name, str):
            raise ApiError(400, f"model must be a string, one of {served}; got {name!r}", "model")
        if name == served_model_name:
            return None
        if name in llm.list_loras():
            return name
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {served}", "model",
                       code="model_not_found")

    @app.get("/health")
    async def health():
        if engine.error is not None:                    # a stopped engine answers nothing: unhealthy
            raise ApiError(500, engine.error_message, kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(request)
        base = {"id": served_model_name, "object": "model", "created": created, "owned_by": "graphdsl",
                "max_model_len": llm.max_model_len}
        adapters = [{**base, "id": n, "parent": served_model_name} for n in llm.list_loras()]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/metrics")
    async def metrics():
        lines = await engine.metrics()
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def _prompt_ids(body: dict, chat: bool) -> tuple[list[int], str | None]:
        tok = llm.tokenizer
        if chat:
            try:
                msgs = chat_messages(body.get("messages"))
            except GraphDSLError as e:
                raise ApiError(400, str(e), "messages") from None
            if tok is None:
                raise ApiError(400, "this model has no tokenizer, so it cannot take chat messages", "messages")
            text = tok.apply_chat_template(msgs, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False), text
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            if tok is None:
                raise ApiError(400, "this model has no tokenizer: send prompt as a list of token ids", "prompt")
            return tok.encode(prompt), prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt), None
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request), "
                            f"got {json.dumps(prompt)[:120]}", "prompt")

    async def _generate(request: Request, chat: bool):
        _auth(request)
        body = await _body(request, chat)
        lora = _model(body)
        ids, text = _prompt_ids(body, chat)
        params = _sampling(body, chat=chat, prompt_len=len(ids), max_model_len=llm.max_model_len)
        if len(ids) < llm.max_model_len:     # a prompt the context cannot hold is refused as such by open()
            _check_room(body, chat, len(ids), params, llm.max_model_len)
        if engine.error is not None:
            raise ApiError(500, engine.error_message, kind="server_error")
        try:
            tracked = await engine.open(ids, text, params, lora, bool(body.get("stream")))
        except GraphDSLError as e:
            raise _refused(str(e), chat) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{tracked.request_id}"
        budget = _max_tokens_field(body, chat)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(tracked, rid, chat, usage, budget),
                                     media_type="text/event-stream")
        result = asyncio.ensure_future(_result(tracked))
        gone = asyncio.ensure_future(_hung_up(request))
        try:
            await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            result.cancel()
            engine.abort(tracked)
            raise
        finally:
            gone.cancel()
        if not result.done():       # the client hung up: nobody will read the answer, so stop generating it
            result.cancel()
            engine.abort(tracked)
            return Response(status_code=499)
        item = result.result()
        if item[0] == "error":
            raise ApiError(500, item[1], kind="server_error")
        if item[0] == "bad":
            raise ApiError(400, item[1], budget)
        return _final(item[1], rid, chat, params, lora or served_model_name)

    async def _result(tracked: _Tracked) -> tuple:
        """The last item of a request that does not stream: its result, or its error."""
        while True:
            item = await tracked.out.get()
            if item[0] in ("error", "bad", "done"):
                return item

    async def _hung_up(request: Request) -> None:
        """Returns once the client has disconnected. The body is read already, so the next ASGI
        message is the disconnect (Starlette listens for it only beside a streaming response)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def _final(result, rid: str, chat: bool, params: SamplingParams, model: str) -> dict:
        choices = []
        for o in result.outputs:
            lp = None
            if params.logprobs is not None and o.logprobs is not None:
                lp = _chosen_logprobs(o.token_ids, o.logprobs, params.logprobs, chat)
            fr = "stop" if o.finish_reason == "stop" else "length"
            if chat:
                choices.append({"index": o.index, "message": {"role": "assistant", "content": o.text},
                                "logprobs": lp, "finish_reason": fr})
            else:
                choices.append({"index": o.index, "text": o.text, "logprobs": lp, "finish_reason": fr})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": _usage(result)}

    async def _stream(tracked: _Tracked, rid: str, chat: bool, include_usage: bool, budget: str):
        """Server-sent events of ``tracked``'s deltas: every item waiting in its queue goes out as one
        write. A client that disconnects cancels this generator while it waits (Starlette listens
        for the disconnect beside the response) or fails its next write, which closes it; either
        way the request is aborted. (No timeout on the wait: ``asyncio.wait_for`` costs ~9 µs a
        token, a sixth of the stream's own time.)"""
        top = tracked.params.logprobs
        first = set()
        offsets: dict[int, int] = {}          # sample index -> text_offset of its next token
        out = tracked.out
        # every chunk shares id, object, created and model; only choices (and usage) differ
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": int(time.time()), "model": tracked.lora or served_model_name})[:-1]

        def chunk(choices: str, usage=None) -> str:
            tail = f', "usage": {json.dumps(usage)}' if include_usage else ""
            return f"data: {head}, \"choices\": {choices}{tail}}}\n\n"

        def event(item) -> str:
            _, index, delta, token, lps, finish = item
            lp = None
            if top is not None and lps is not None:
                lp = _chosen_logprobs([token], [lps], top, chat, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(lps[token].decoded_token or "")
            fr = None if finish is None else ("stop" if finish == "stop" else "length")
            role = chat and index not in first
            if role:
                first.add(index)
            return chunk(f"[{_choice_json(index, delta, chat, role, lp, fr)}]")
        try:
            while True:
                items = [await out.get()]
                while not out.empty():
                    items.append(out.get_nowait())
                text = []
                for item in items:
                    if item[0] in ("error", "bad"):
                        err = ApiError(500, item[1], kind="server_error") if item[0] == "error" else \
                            ApiError(400, item[1], budget)
                        yield "".join(text) + f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n"   # as vLLM
                        return
                    if item[0] == "done":
                        if include_usage:
                            text.append(chunk("[]", _usage(item[1])))
                        yield "".join(text) + "data: [DONE]\n\n"
                        return
                    text.append(event(item))
                yield "".join(text)
        except (asyncio.CancelledError, GeneratorExit):
            engine.abort(tracked)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    return app
