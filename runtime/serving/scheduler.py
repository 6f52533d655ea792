"""Continuous batching: which requests run in each model step, and what happens after it.

Every step the scheduler fills a token budget (``max_num_batched_tokens``) and a sequence budget
(``max_num_seqs``):

1. **Running requests first**, oldest first. A decoding request asks for one token; one in the
   middle of a chunked prefill asks for ``min(tokens left, budget left)``. Its KV blocks are grown
   before it is scheduled; when the pool is empty, the *newest* running request that is not yet
   in this step is preempted (its blocks freed, it returns to the waiting queue in arrival order
   and later recomputes prompt + generated tokens as a prefill). If no other request can give way,
   the asking request is preempted itself.
2. **Waiting requests** are admitted in arrival order (no overtaking) while budgets and free
   blocks allow; a prompt longer than the budget left is chunked.

A scheduled chunk covers token positions ``[start, end)`` of the request's tokens (prompt +
generated). When ``end`` reaches the last token the request samples its next token.

**Tokens in flight.** The serving loop (:mod:`.loop`) schedules step N+1 before it has read step
N's sampled tokens back from the device, so a request may own tokens the host does not know yet:
``schedule`` counts each sampling chunk's token as *pending* (``Request.num_pending``) and moves
``num_computed`` past the chunk at once; ``update`` later fills the pending tokens in, in order.
A pending token's value is on the device, and the loop feeds it to the next step from there.
The host therefore always knows how many tokens each request has (``num_tokens``), so a request
that reached ``max_tokens`` or ``max_model_len`` with tokens still pending is not scheduled again;
only an EOS, stop token or stop string is learned a step late, and the extra token computed in the
meantime is dropped. A preempted request with pending tokens waits for them before it is readmitted.

**Parallel samples.** ``SamplingParams.n > 1`` makes ``n`` requests; sample ``i > 0`` names sample 0
as its ``parent``. When the parent has computed the prompt's full blocks before the last prompt
token, the sample is admitted sharing those blocks (:meth:`BlockManager.fork`) and computes only
the rest of the prompt; otherwise it computes the whole prompt itself.

Preemption loses nothing: the recompute rebuilds the same KV cache and sampling noise depends only
on the request's seed and the token position, so the request finishes with the output it would
have had alone. ``tests/core/test_scheduler.py`` checks this against one-by-one runs.
"""
from __future__ import annotations

import array
import enum
import itertools
import random
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from graphdsl.errors import GraphDSLError

from .kv_cache import BlockManager
from .sampling import SamplingParams

__all__ = ["RequestStatus", "Request", "Chunk", "StepBatch", "Scheduler", "TokenEvent"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request (one sample of a prompt) and its progress."""

    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    seed: int = 0                         # drives the sampling noise (params.seed, or drawn at add time)
    parent: "Request | None" = None       # sample 0 of the same prompt, for samples 1..n-1
    output_ids: list[int] = field(default_factory=list)
    num_pending: int = 0                  # sampled on the device, not yet read back
    num_computed: int = 0                 # leading tokens whose KV is (or is being) written
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    prompt_logprobs: list | None = None   # filled by the serving loop when params.prompt_logprobs is set
    prompt_lp_done: int = 1               # prompt positions whose logprobs are computed (0 has none)
    lora: str | None = None               # the LoRA adapter it runs with (None: the base model)
    sampling_row: dict | None = None      # the serving loop's SamplingTensors row (cached; None: make it again)

    @property
    def token_ids(self) -> list[int]:
        """The known tokens: prompt then generated (pending ones excluded)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, pending ones included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens ``[start, end)`` (prompt then generated) without copying the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]


@dataclass
class Chunk:
    """Positions ``[start, end)`` of ``request`` computed in one step; ``samples`` when the step
    draws the request's next token from the chunk's last position."""

    request: Request
    start: int
    end: int
    samples: bool = False


@dataclass
class StepBatch:
    chunks: list[Chunk]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    @property
    def is_decode(self) -> bool:
        """Every chunk is one new token after a cached context, and samples (a decode-only step)."""
        return all(c.end - c.start == 1 and c.start > 0 and c.samples for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.samples]

    def model_inputs(self, blocks: BlockManager, device="cpu") -> dict[str, torch.Tensor]:
        """The standard per-step tensors: ``input_ids``, ``positions``, ``slot_mapping`` (int64,
        one per scheduled token), ``block_tables`` [num_seqs, max_blocks] int32 (padded with 0),
        ``seq_lens`` (context incl. this chunk) and ``query_start_loc`` (int32), and
        ``lm_head_indices`` (int64: the last token of each sampling chunk, in chunk order).
        Pending tokens (not yet known on the host) are given as 0: :meth:`pending_inputs` says where."""
        ids, pos, slots, qsl, lens, heads, tables = [], [], [], [0], [], [], []
        bs = blocks.block_size
        for c in self.chunks:
            req, start, end = c.request, c.start, c.end
            table = blocks.block_table_array(req.request_id)
            known = min(end, len(req.prompt_ids) + len(req.output_ids))
            if end - start == 1:                 # a decode row (most rows of a mixed step): no lists made
                ids.append(req.tokens(start, end)[0] if known > start else 0)
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids += req.tokens(start, known) if known > start else []
                ids += [0] * (end - max(known, start))
                pos += range(start, end)
                slots += blocks.slot_mapping(req.request_id, start, end)
            qsl.append(qsl[-1] + end - start)
            lens.append(end)
            tables.append(table)
            if c.samples:
                heads.append(qsl[-1] - 1)
        width = max(len(t) for t in tables)
        return to_device(device, {"input_ids": (ids, torch.int64), "positions": (pos, torch.int64),
                                  "slot_mapping": (slots, torch.int64), "lm_head_indices": (heads, torch.int64),
                                  "block_tables": (padded_rows(tables, width), torch.int32),
                                  "seq_lens": (lens, torch.int32), "query_start_loc": (qsl, torch.int32)},
                         shapes={"block_tables": (len(tables), width)})

    def pending_inputs(self) -> list[tuple[int, Request]]:
        """``(index in input_ids, request)`` for every scheduled token whose value is still on the
        device (sampled by a step whose result the host has not read yet)."""
        out, at = [], 0
        for c in self.chunks:
            req = c.request
            known = len(req.prompt_ids) + len(req.output_ids)
            if c.end > known:
                out += [(at + p - c.start, req) for p in range(max(c.start, known), c.end)]
            at += c.end - c.start
        return out


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}
_ALIGN = 16          # bytes: each field of a to_device copy starts on this boundary


def padded_rows(rows: list[array.array], width: int, total_rows: int | None = None) -> array.array:
    """``rows`` (block tables, int32 ``array.array`` s: :meth:`BlockManager.block_table_array`) as
    one flat int32 array of ``total_rows`` (default ``len(rows)``) rows of ``width``, each padded
    with 0. A row is one memcpy; the same tables as Python lists cost a conversion an entry (256
    rows x 96 blocks: ~600 µs of an H200 host's time a step)."""
    out = array.array("i", bytes(4 * width * (len(rows) if total_rows is None else total_rows)))
    for r, row in enumerate(rows):
        out[r * width:r * width + len(row)] = row
    return out


def to_device(device, fields: dict[str, tuple[Sequence, torch.dtype]],
              shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """One host-to-device copy for all of ``fields`` (name -> (Python numbers or an ``array.array``
    of the dtype's type code; ``int64`` / ``int32`` / ``float32``)): each list is packed through an
    ``array.array`` (about 4x faster than ``torch.tensor(list)``) into one buffer, starting on a
    16-byte boundary (kernels may assume aligned pointers), and handed out as views of the device
    copy, shaped by ``shapes``. On CUDA the buffer is staged in pinned memory and copied without
    blocking the host. (A pinned ring reused across copies was no faster on an H200 host:
    docs/serving.md, session 34.)"""
    shapes = shapes or {}
    device = torch.device(device)
    layout, nbytes = [], 0                  # (name, byte offset, bytes, dtype)
    for name, (values, dtype) in fields.items():
        if not (isinstance(values, array.array) and values.typecode == _ARRAY_CODES[dtype]):
            values = array.array(_ARRAY_CODES[dtype], values)
        data = memoryview(values).cast("B")
        layout.append((name, nbytes, data, dtype))
        nbytes += -(-len(data) // _ALIGN) * _ALIGN
    raw = bytearray(max(nbytes, _ALIGN))
    for _, off, data, _ in layout:
        raw[off:off + len(data)] = data
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    if device.type == "cuda":
        buf = buf.pin_memory().to(device, non_blocking=True)
    else:
        buf = buf.to(device)
    out = {}
    for name, off, data, dtype in layout:
        view = buf[off:off + len(data)].view(dtype)
        out[name] = view.view(shapes[name]) if name in shapes else view
    return out


@dataclass
class TokenEvent:
    """A sampled token; ``finished`` is set on the request's last one. ``index`` is the token's place
    among the request's generated tokens."""

    request: Request
    token_id: int
    finished: bool
    index: int = 0
    logprobs: dict | None = None          # {token id: Logprob} when params.logprobs is set


class Scheduler:
    """Continuous batching over a :class:`BlockManager` (see the module docstring)."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: Sequence[int] = (), max_loras: int | None = None):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GraphDSLError(f"Scheduler: {name} must be an integer >= 1, got {v!r}")
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_loras = max_loras                # distinct LoRA adapters running at once (None: no limit)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self._ids: set = set()
        self._seeds = random.Random()
        self.num_preemptions = 0                  # over this scheduler's life (requests recomputed)
        self.num_steps = 0                        # batches handed out by schedule()

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams, *,
                    parent: Request | None = None, seed: int | None = None, lora: str | None = None) -> Request:
        """Queue a request; raises on an empty prompt, a prompt that leaves no room to generate
        within ``max_model_len``, or one that needs more KV blocks than the whole pool
        (``params.max_tokens`` None: up to ``max_model_len``, as in vLLM). ``seed``
        (default ``params.seed``, else a random one) drives its sampling noise; ``parent`` is sample 0
        of the same prompt, whose prompt blocks this one may share."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise GraphDSLError(f"request {request_id!r}: the prompt is empty (it needs at least one token)")
        if len(prompt) >= self.max_model_len:
            raise GraphDSLError(f"request {request_id!r}: the prompt has {len(prompt)} tokens, but max_model_len is "
                                f"{self.max_model_len} (at most {self.max_model_len - 1} prompt tokens leave room "
                                "for one generated token)")
        if params.max_tokens is None:        # vLLM's None: as many tokens as max_model_len leaves room for
            params = params.model_copy(update={"max_tokens": self.max_model_len - len(prompt)})
        need = self.blocks.blocks_needed(min(len(prompt) + params.max_tokens, self.max_model_len))
        if need > self.blocks.num_blocks:
            raise GraphDSLError(f"request {request_id!r}: {len(prompt)} prompt + {params.max_tokens} new tokens need "
                                f"{need} KV blocks, but the cache has only {self.blocks.num_blocks}; lower max_tokens "
                                "or give the cache more memory")
        if request_id in self._ids:
            raise GraphDSLError(f"request id {request_id!r} is already in use")
        self._ids.add(request_id)
        if seed is None:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(request_id, prompt, params, next(self._arrivals), seed=seed, parent=parent, lora=lora)
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``request`` now (stop string found by the caller, abort, ...)."""
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        if request.request_id in self.blocks:
            self.blocks.free(request.request_id)
        request.status, request.finish_reason, request.stop_reason = RequestStatus.FINISHED, reason, stop_reason
        self._ids.discard(request.request_id)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        """The next step's chunks. May be empty while every request waits for pending tokens."""
        budget = self.max_num_batched_tokens
        batch = StepBatch([])
        scheduled: set[int] = set()
        preempted: set[int] = set()
        blocks = self.blocks
        max_len = self.max_model_len
        for req in list(self.running):       # every running request, every step: its lengths read once
            if budget == 0:
                break
            generated = len(req.output_ids) + req.num_pending
            total = len(req.prompt_ids) + generated
            if id(req) in preempted or generated >= req.params.max_tokens or total >= max_len:
                continue                     # preempted, or every token sampled (some maybe pending)
            n = min(total - req.num_computed, budget)
            while not blocks.try_grow_to(req.request_id, req.num_computed + n):
                victims = [r for r in self.running if id(r) not in scheduled and r is not req]
                victim = max(victims, key=lambda r: r.arrival) if victims else req
                self._preempt(victim)
                preempted.add(id(victim))
                batch.preempted.append(victim)
                if victim is req:
                    break
            if id(req) in preempted:
                continue
            self._add_chunk(batch, req, req.num_computed, n)
            scheduled.add(id(req))
            budget -= n
        adapters = {r.lora for r in self.running if r.lora is not None}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:                      # preempted with tokens in flight: wait for them
                break
            if req.lora is not None and self.max_loras is not None and req.lora not in adapters \
                    and len(adapters) >= self.max_loras:
                break                                # every LoRA slot is taken by running requests
            start = self._shared_prefix(req, batch)
            if start is None:                        # its parent is still computing the shared prompt
                break
            n = min(req.num_tokens - start, budget)
            if start:
                if self.blocks.blocks_needed(start + n) - start // self.blocks.block_size > self.blocks.num_free_blocks:
                    break
                self.blocks.fork(req.parent.request_id, req.request_id, start)
                self.blocks.append(req.request_id, n)
            else:
                if not self.blocks.can_allocate(n):
                    break
                self.blocks.allocate(req.request_id, n)
            self.waiting.pop(0)
            if req.lora is not None:
                adapters.add(req.lora)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(batch, req, start, n)
            budget -= n
        if not batch.chunks and self.has_unfinished() and not any(r.num_pending for r in self.running + self.waiting):
            raise GraphDSLError(f"scheduler stalled: {len(self.waiting)} waiting and {len(self.running)} running "
                                f"requests, {self.blocks.num_free_blocks} free blocks, token budget "
                                f"{self.max_num_batched_tokens}")
        if batch.chunks:
            self.num_steps += 1
        return batch

    def _add_chunk(self, batch: StepBatch, req: Request, start: int, n: int) -> None:
        req.num_computed = start + n
        samples = req.num_computed == req.num_tokens
        if samples:
            req.num_pending += 1
        batch.chunks.append(Chunk(req, start, start + n, samples))

    def _shared_prefix(self, req: Request, batch: StepBatch) -> int | None:
        """Tokens ``req`` can take from its parent's blocks (0: none), or None to wait until a step
        before this one has computed them."""
        parent = req.parent
        if parent is None or req.num_known != len(req.prompt_ids) or parent.status is not RequestStatus.RUNNING:
            return 0
        share = (len(req.prompt_ids) - 1) // self.blocks.block_size * self.blocks.block_size
        if share == 0:
            return 0
        computing = any(c.request is parent and c.start < share for c in batch.chunks)
        return share if parent.num_computed >= share and not computing else None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.num_computed, req.status = 0, RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        at = next((i for i, w in enumerate(self.waiting) if w.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(at, req)

    def update(self, batch: StepBatch, sampled: Sequence[int]) -> list[TokenEvent]:
        """Record a step's results; ``sampled`` holds one token per sampling chunk, in order. A token
        of a request that finished meanwhile (EOS seen a step late, abort) is dropped."""
        chunks = batch.sampling_chunks
        if len(sampled) != len(chunks):
            raise GraphDSLError(f"update: expected {len(chunks)} sampled tokens (one per sampling chunk), got {len(sampled)}")
        events = []
        for c, tok in zip(chunks, sampled):
            req = c.request
            req.num_pending -= 1
            if req.status is RequestStatus.FINISHED:
                continue
            tok = int(tok)
            req.output_ids.append(tok)
            reason, stop = self._finish_reason(req, tok)
            if reason:
                self.finish(req, reason, stop)
            events.append(TokenEvent(req, tok, reason is not None, len(req.output_ids) - 1))
        return events

    def _finish_reason(self, req: Request, tok: int) -> tuple[str | None, int | None]:
        p = req.params
        if len(req.output_ids) > p.min_tokens:         # EOS / stop ids count after min_tokens
            if tok in p.stop_token_ids:
                return "stop", tok
            if tok in self.eos_token_ids and not p.ignore_eos:
                return "stop", None
        if len(req.output_ids) >= p.max_tokens or req.num_known >= self.max_model_len:
            return "length", None
        return None, None
