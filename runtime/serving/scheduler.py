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

A scheduled chunk covers token positions ``[start, end)`` of the request's known tokens (prompt +
generated). When ``end`` reaches the last known token the request samples its next token.
Preemption loses nothing: the recompute rebuilds the same KV cache, the per-request sampling
generator has advanced only on real draws, so the request finishes with the output it would have
had alone. ``tests/core/test_scheduler.py`` checks this against one-by-one runs.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Sequence

import torch

from graphdsl.errors import GraphDSLError

from .kv_cache import BlockManager
from .sampling import SamplingParams, make_generator, sample

__all__ = ["RequestStatus", "Request", "Chunk", "StepBatch", "Scheduler", "TokenEvent", "run_steps"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its progress."""

    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0                 # leading tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    num_preemptions: int = 0
    generator: torch.Generator | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

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
    """Positions ``[start, end)`` of ``request`` computed in one step."""

    request: Request
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == self.request.num_tokens


@dataclass
class StepBatch:
    chunks: list[Chunk]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    @property
    def is_decode(self) -> bool:
        """Every chunk is one new token after a cached context (a decode-only step)."""
        return all(c.end - c.start == 1 and c.start > 0 for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.samples]

    def model_inputs(self, blocks: BlockManager, device="cpu") -> dict[str, torch.Tensor]:
        """The standard per-step tensors: ``input_ids``, ``positions``, ``slot_mapping`` (int64,
        one per scheduled token), ``block_tables`` [num_seqs, max_blocks] int32 (padded with 0),
        ``seq_lens`` (context incl. this chunk) and ``query_start_loc`` (int32), and
        ``lm_head_indices`` (int64: the last token of each sampling chunk, in chunk order)."""
        ids, pos, slots, qsl, lens, heads, tables = [], [], [], [0], [], [], []
        for c in self.chunks:
            rid = c.request.request_id
            ids += c.request.tokens(c.start, c.end)
            pos += range(c.start, c.end)
            slots += blocks.slot_mapping(rid, c.start, c.end)
            qsl.append(qsl[-1] + c.end - c.start)
            lens.append(c.end)
            tables.append(blocks.block_table(rid))
            if c.samples:
                heads.append(qsl[-1] - 1)
        width = max(len(t) for t in tables)
        flat_tables = [b for t in tables for b in t + [0] * (width - len(t))]
        return _to_device(device, {"input_ids": (ids, torch.int64), "positions": (list(pos), torch.int64),
                                   "slot_mapping": (slots, torch.int64), "lm_head_indices": (heads, torch.int64),
                                   "block_tables": (flat_tables, torch.int32), "seq_lens": (lens, torch.int32),
                                   "query_start_loc": (qsl, torch.int32)},
                          shapes={"block_tables": (len(tables), width)})


def _to_device(device, fields: dict[str, tuple[list[int], torch.dtype]],
               shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """One host-to-device copy per dtype: the lists are packed into one buffer, each starting at
    a 16-byte boundary (kernels may assume aligned pointers), and handed out as views."""
    out = {}
    for dt in (torch.int64, torch.int32):
        names = [k for k, (_, d) in fields.items() if d is dt]
        align = 16 // torch.empty((), dtype=dt).element_size()
        packed, offsets = [], {}
        for k in names:
            offsets[k] = len(packed)
            vals = fields[k][0]
            packed += vals + [0] * (-len(vals) % align)
        buf = torch.tensor(packed, dtype=dt).to(device)
        for k in names:
            n = len(fields[k][0])
            view = buf[offsets[k]:offsets[k] + n]
            out[k] = view.view(shapes[k]) if k in shapes else view
    return out


@dataclass
class TokenEvent:
    """A sampled token; ``finished`` is set on the request's last one."""

    request: Request
    token_id: int
    finished: bool


class Scheduler:
    """Continuous batching over a :class:`BlockManager` (see the module docstring)."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: Sequence[int] = (), device="cpu"):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GraphDSLError(f"Scheduler: {name} must be an integer >= 1, got {v!r}")
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device                      # where per-request sampling generators live
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self._ids: set = set()
        self.num_preemptions = 0                  # over this scheduler's life (requests recomputed)
        self.num_steps = 0                        # batches handed out by schedule()

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request; raises on an empty prompt, a prompt that leaves no room to generate
        within ``max_model_len``, or one that needs more KV blocks than the whole pool."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise GraphDSLError(f"request {request_id!r}: the prompt is empty (it needs at least one token)")
        if len(prompt) >= self.max_model_len:
            raise GraphDSLError(f"request {request_id!r}: the prompt has {len(prompt)} tokens, but max_model_len is "
                                f"{self.max_model_len} (at most {self.max_model_len - 1} prompt tokens leave room "
                                "for one generated token)")
        need = self.blocks.blocks_needed(min(len(prompt) + params.max_tokens, self.max_model_len))
        if need > self.blocks.num_blocks:
            raise GraphDSLError(f"request {request_id!r}: {len(prompt)} prompt + {params.max_tokens} new tokens need "
                                f"{need} KV blocks, but the cache has only {self.blocks.num_blocks}; lower max_tokens "
                                "or give the cache more memory")
        if request_id in self._ids:
            raise GraphDSLError(f"request id {request_id!r} is already in use")
        self._ids.add(request_id)
        req = Request(request_id, prompt, params, next(self._arrivals), generator=make_generator(params, self.device))
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """End ``request`` now (stop string found by the caller, abort, ...)."""
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        if request.request_id in self.blocks:
            self.blocks.free(request.request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self._ids.discard(request.request_id)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        budget = self.max_num_batched_tokens
        batch = StepBatch([])
        scheduled: set[int] = set()
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:          # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self.blocks.can_append(req.request_id, req.num_computed + n - self.blocks.num_tokens(req.request_id)):
                victims = [r for r in self.running if id(r) not in scheduled and r is not req]
                victim = max(victims, key=lambda r: r.arrival) if victims else req
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req not in self.running:
                continue
            grow = req.num_computed + n - self.blocks.num_tokens(req.request_id)
            if grow > 0:
                self.blocks.append(req.request_id, grow)
            batch.chunks.append(Chunk(req, req.num_computed, req.num_computed + n))
            scheduled.add(id(req))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens, budget)
            if not self.blocks.can_allocate(n):
                break
            self.waiting.pop(0)
            self.blocks.allocate(req.request_id, n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.chunks.append(Chunk(req, 0, n))
            budget -= n
        if not batch.chunks and self.has_unfinished():
            raise GraphDSLError(f"scheduler stalled: {len(self.waiting)} waiting and {len(self.running)} running "
                                f"requests, {self.blocks.num_free_blocks} free blocks, token budget "
                                f"{self.max_num_batched_tokens}")
        if batch.chunks:
            self.num_steps += 1
        return batch

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.num_computed, req.status = 0, RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        at = next((i for i, w in enumerate(self.waiting) if w.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(at, req)

    def update(self, batch: StepBatch, sampled: Sequence[int]) -> list[TokenEvent]:
        """Record a step's results; ``sampled`` holds one token per sampling chunk, in order."""
        chunks = batch.sampling_chunks
        if len(sampled) != len(chunks):
            raise GraphDSLError(f"update: expected {len(chunks)} sampled tokens (one per sampling chunk), got {len(sampled)}")
        events = []
        for c in batch.chunks:
            c.request.num_computed = c.end
        for c, tok in zip(chunks, sampled):
            req = c.request
            tok = int(tok)
            req.output_ids.append(tok)
            reason = self._finish_reason(req, tok)
            if reason:
                self.finish(req, reason)
            events.append(TokenEvent(req, tok, reason is not None))
        return events

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None


def run_steps(scheduler: Scheduler, execute: Callable[[StepBatch], torch.Tensor]) -> Iterator[TokenEvent]:
    """Drive ``scheduler`` to completion: ``execute(batch)`` returns float32 logits
    ``[len(batch.sampling_chunks), vocab]`` (on any device; tokens are drawn there, with each
    request's generator made on ``scheduler.device``) and tokens are yielded as they come.

    Between two events the caller may end a request with ``scheduler.finish`` (a stop string it
    found in the text, say): the next step no longer schedules it."""
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        chunks = batch.sampling_chunks
        logits = execute(batch)
        if chunks:
            reqs = [c.request for c in chunks]
            # only a repetition penalty looks at earlier tokens: skip building the others' lists
            prev = [r.token_ids if r.params.repetition_penalty != 1.0 else [] for r in reqs]
            tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], prev).tolist()
        else:
            tokens = []
        yield from scheduler.update(batch, tokens)
