"""The serving loop: schedule, launch, sample on the device, and read tokens back one step late.

Each :meth:`ServingLoop.step` schedules step N+1, launches it (model, sampling, bookkeeping on
the device), and only then reads step N's tokens: the host waits on step N's event while the GPU
already runs step N+1, so host work (scheduling, detokenising, stop strings) overlaps the GPU.
Sampled tokens never round-trip through the host to feed the model: a decode step's inputs are
persistent device buffers (``input_ids``, ``positions``, ``seq_lens``, ``block_tables``) that the
previous step advanced in place (``input_ids <- sampled``, ``positions += 1``, ``seq_lens += 1``:
the CUDA graph's epilogue, or the loop when decode runs eagerly);
the host writes a block-table entry only when a row enters a new KV block, and rebuilds the
buffers only when the batch's rows change (a request joins, finishes or is preempted). Tokens
reach the host through a non-blocking copy into pinned memory and a CUDA event.

``overlap=False`` (or ``GRAPHDSL_OVERLAP=0``) reads every step's tokens before the next one is
scheduled: the same results, one step sooner, for debugging.

Prefill steps are padded to a few shape buckets (:mod:`.prefill_pad`) on CUDA, so the prefill
engine specialises once per bucket instead of once per step; ``GRAPHDSL_PREFILL_BUCKETS=0`` turns
that off, ``=1`` turns it on elsewhere too.

The loop speaks to the model through a :class:`StepExecutor` (``graphdsl.models.executor`` wraps a
``FlashCausalLM``): ``execute(phase, inputs)`` runs an engine eagerly and returns float32 logits,
and ``decode_graph(rows)`` optionally gives a CUDA-graph step whose static inputs *are* the
persistent buffers, which also computes ``slot_mapping`` from them and the greedy argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from graphdsl.env import env_flag
from graphdsl.errors import GraphDSLError
from graphdsl.runtime import precompile

from .outputs import Logprob
from .sampler import PenaltyState, SamplingTensors, compute_logprobs, sample
from .kv_cache import decode_slots
from .prefill_pad import STANDARD_INPUTS, pad_prefill
from .scheduler import Chunk, Request, RequestStatus, Scheduler, StepBatch, TokenEvent, padded_rows, to_device

__all__ = ["StepExecutor", "DecodeGraph", "ServingLoop", "overlap_enabled", "prefill_buckets_enabled"]


class DecodeGraph(Protocol):
    """A captured decode step for up to ``rows`` requests whose KV blocks fit ``width`` block-table
    columns. ``inputs`` are its static buffers
    (``input_ids``, ``positions``, ``seq_lens`` [rows], ``block_tables`` [rows, width]; a LoRA
    graph also ``lora_indices`` [rows]); rows past the batch hold padding (``seq_lens`` 0, slot
    -1). ``replay(n)`` runs it and returns ``(logits [n, vocab], argmax [n] int64)`` (the logits in
    the model's dtype or float32: the sampler and the logprobs read either), views
    valid until the next replay; the replay also advances the inputs to the next step of the same
    rows (``input_ids <- argmax``, ``positions`` and ``seq_lens`` + 1 on real rows)."""

    rows: int
    width: int
    inputs: dict[str, torch.Tensor]

    def replay(self, n: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class StepExecutor(Protocol):
    device: torch.device
    vocab_size: int
    block_size: int
    max_blocks_per_seq: int

    def execute(self, phase: str, inputs: dict[str, torch.Tensor], rows: int | None = None) -> torch.Tensor:
        """Run one step eagerly (``phase`` "prefill" or "decode"); float32 logits of its first
        ``rows`` rows (None: all; a padded step's rows past them are not cast)."""

    def decode_graph(self, n: int, lora: bool = False, width: int | None = None) -> DecodeGraph | None:
        """A CUDA-graph decode step with room for ``n`` rows of at least ``width`` KV blocks each
        (None: ``max_blocks_per_seq``), or None (eager decode); ``lora``: of the LoRA engine, its
        inputs also holding ``lora_indices`` [rows]. A graph of a narrower block table is faster
        at short contexts (the attention launches fewer programs)."""

    def lora_slots(self, names: list[str | None]) -> list[int]:
        """The LoRA slot of each adapter name (-1 for None), loading adapters into slots as needed."""

    # Optional: ``verify_step()``, called once a step's tokens have reached the host, raises when
    # they cannot be trusted (rank 0 of a tensor-parallel group whose worker died meanwhile).
    # Optional: ``wait_step(event)``, waits for a step's CUDA event in place of
    # ``event.synchronize()`` and raises when the step can never end (a collective in it waits for
    # a tensor-parallel worker that died).


def overlap_enabled(flag: bool) -> bool:
    """``flag`` unless ``GRAPHDSL_OVERLAP=0`` turns the overlap off."""
    return flag and env_flag("GRAPHDSL_OVERLAP", True)


def prefill_buckets_enabled(device: torch.device) -> bool:
    """Pad prefill steps to shape buckets: on CUDA unless ``GRAPHDSL_PREFILL_BUCKETS=0``; elsewhere
    only with ``GRAPHDSL_PREFILL_BUCKETS=1``."""
    return env_flag("GRAPHDSL_PREFILL_BUCKETS", device.type == "cuda")


@dataclass
class _Flight:
    """A launched step whose tokens the host has not read yet."""

    batch: StepBatch
    tokens: torch.Tensor                      # device int64 [num sampling chunks]
    host: torch.Tensor                        # the copy the host reads (pinned on CUDA)
    event: torch.cuda.Event | None
    row_of: dict[int, int]                    # id(request) -> row in tokens
    logprobs: tuple | None = None             # host copies of compute_logprobs' four tensors
    prompt_rows: list = field(default_factory=list)   # (request, first position, host logprob tensors)


@dataclass
class _Rows:
    """The persistent decode batch: the request in each row and the device buffers."""

    requests: list[Request]
    bufs: dict[str, torch.Tensor]
    graph: DecodeGraph | None
    sampling: SamplingTensors
    ban: tuple | None = None                  # (ids [n, B], prompt_len [n], min_tokens [n]) device
    launched: bool = False                    # a step of these rows ran (buffers advanced past it)
    lora_slots: list[int] | None = None       # graph rows with adapters: the slots bufs["lora_indices"] holds


class ServingLoop:
    """Drives a :class:`Scheduler` through a :class:`StepExecutor` (see the module docstring).

    Args:
        executor: runs the model.
        scheduler: owns requests and KV blocks.
        overlap: read tokens one step late (default); False reads each step's tokens at once.
        logprob_decoder: ``fn(token_id) -> str`` naming tokens in logprob dicts (optional).
    """

    def __init__(self, executor: StepExecutor, scheduler: Scheduler, *, overlap: bool = True,
                 logprob_decoder=None):
        self.executor, self.scheduler = executor, scheduler
        self._verify = getattr(executor, "verify_step", None)     # optional (StepExecutor)
        self._wait = getattr(executor, "wait_step", None)         # optional (StepExecutor)
        self.device = torch.device(executor.device)
        self.overlap = overlap_enabled(overlap)
        self.prefill_buckets = prefill_buckets_enabled(self.device)
        self.decode_name = logprob_decoder
        self._flight: _Flight | None = None
        self._rows: _Rows | None = None
        self._penalties: PenaltyState | None = None
        self._slots: dict[int, int] = {}          # id(request) -> penalty slot
        self._slot_owner: dict[int, Request] = {}
        self._free_slots: list[int] = []
        self._pinned: dict[tuple, list[torch.Tensor]] = {}   # reusable pinned host buffers
        self._drawn: set[tuple] = set()           # kinds of draw seen (_draw: the first runs watched)
        self.num_steps = 0

    # -- public ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self._flight is not None

    def step(self) -> list[TokenEvent]:
        """Schedule and launch the next step, then collect the previous one (overlap) or this one.
        Returns the tokens learned, with ``TokenEvent.logprobs`` filled where asked for; a request's
        prompt logprobs land in ``Request.prompt_logprobs``."""
        sched = self.scheduler
        self._release_slots()
        flight = None
        if sched.has_unfinished():
            batch = sched.schedule()
            if batch.preempted:
                self._rows = None
            if batch.chunks:
                flight = self._launch(batch)
                self.num_steps += 1
        prev, self._flight = self._flight, flight
        events = self._collect(prev) if prev is not None else []
        if not self.overlap and flight is not None:
            self._flight = None
            events += self._collect(flight)
        return events

    def abort(self, request: Request) -> None:
        """End ``request`` now; its blocks return to the pool (a step in flight may still compute
        its row, whose token is dropped)."""
        self.scheduler.finish(request, "abort")

    def drain(self) -> list[TokenEvent]:
        """Collect the step in flight, if any (used when the caller stops early)."""
        prev, self._flight = self._flight, None
        return self._collect(prev) if prev is not None else []

    # -- launching ---------------------------------------------------------------------------
    def _launch(self, batch: StepBatch) -> _Flight:
        chunks = batch.sampling_chunks
        if batch.is_decode:
            logits, greedy, rows = self._decode(batch)
            # the buffers already hold the next step's positions: the position of the token drawn now
            st, counters = rows.sampling, rows.bufs["positions"][:len(chunks)]
            banned = self._banned(rows, counters)
            prompt_rows: list = []
        else:
            self._rows = None
            logits, prompt_rows = self._prefill(batch)
            greedy, rows = None, None
            st = self._sampling_tensors([c.request for c in chunks])
            counters = to_device(self.device, {"c": ([c.end for c in chunks], torch.int64)})["c"]
            banned = self._banned_host(chunks)
        reqs = [c.request for c in chunks]
        asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        raw = logits.clone() if asked else logits          # sample() may change logits in place
        if greedy is not None and st.all_greedy and not st.any_penalty and banned is None:
            tokens = greedy
        else:       # counted for the penalties, and written as the next step's inputs, by the draw
            tokens = self._draw(logits, st, counters, banned,
                                rows.bufs["input_ids"][:len(chunks)] if rows is not None else None)
        lp = compute_logprobs(raw, tokens, max(asked)) if asked else None
        return self._read_back(batch, tokens, lp, prompt_rows, reqs)

    def _draw(self, logits: torch.Tensor, st: SamplingTensors, counters: torch.Tensor, banned, into) -> torch.Tensor:
        """:func:`.sampler.sample` of the step (``record``: the draw counts the tokens for the
        penalties; ``into``: and writes them as the next step's inputs). The first draw of each kind
        (rows, logits dtype, the settings that pick the sampler's kernels) runs watched
        (:func:`graphdsl.runtime.precompile.run_ahead`) on a copy of the logits, which ``sample`` may
        change in place: at the first Triton kernel missing from the disk cache the rest turns dry,
        the sampler's missing kernels compile on worker processes in one round, and the draw runs
        again on the logits. Only the draw's last launch records and writes ``into``, so a draw cut
        off before it leaves nothing behind. Before, a server's first sampled batches compiled the
        sampler's kernels one after another (a cold warm-up's decode batch 2: 12.6 s, batch 32:
        21.7 s; Llama-3.2-1B, an H200)."""
        penalties = self._penalties if st.any_penalty else None

        def draw(lg: torch.Tensor) -> torch.Tensor:
            return sample(lg, st, counters, penalties=penalties, banned=banned, record=True, into=into)
        kind = (tuple(logits.shape), logits.dtype, st.all_greedy, st.any_greedy, st.any_penalty, st.max_top_k,
                st.any_top_p, st.any_min_p, st.full_sort, st.all_top_k,
                None if banned is None else tuple(banned.shape), into is None)
        if kind in self._drawn or not precompile.applies(logits.device):
            return draw(logits)
        self._drawn.add(kind)
        return precompile.run_watched(lambda: draw(logits.clone()), f"sampler, {logits.shape[0]} rows",
                                      again=lambda: draw(logits))

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying ``t`` to the host (into pinned memory on CUDA, without blocking)."""
        if self.device.type != "cuda":
            return t.clone()
        key = (tuple(t.shape), t.dtype)
        pool = self._pinned.setdefault(key, [])
        h = pool.pop() if pool else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        return h

    def _recycle(self, flight: _Flight) -> None:
        """Return a collected flight's pinned buffers to the pool."""
        if self.device.type != "cuda":
            return
        hosts = [flight.host, *(flight.logprobs or ())] + [h for _, _, hs in flight.prompt_rows for h in hs]
        for h in hosts:
            self._pinned.setdefault((tuple(h.shape), h.dtype), []).append(h)

    def _read_back(self, batch, tokens, lp, prompt_rows, reqs) -> _Flight:
        if precompile.dry_pass_running():     # nothing was launched: these are unwritten memory, which the
            for t in (tokens, *(lp or ()), *(x for _, _, ts in prompt_rows for x in ts)):
                t.zero_()                      # host and the next step's inputs would read as token ids
        host = self._to_host(tokens)
        lp_host = tuple(self._to_host(t) for t in lp) if lp is not None else None
        moved = [(req, first, tuple(self._to_host(t) for t in tensors)) for req, first, tensors in prompt_rows]
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return _Flight(batch, tokens, host, event, {id(r): i for i, r in enumerate(reqs)}, lp_host, moved)

    def _pending_ids(self, batch: StepBatch) -> list[tuple[int, int]]:
        """``(index in input_ids, row in the previous step's tokens)`` of tokens still on the device."""
        pending = batch.pending_inputs()
        row_of = self._flight.row_of if self._flight is not None else {}
        out = [(at, row_of.get(id(req))) for at, req in pending]
        for (_, row), (_, req) in zip(out, pending):
            if row is None:
                raise GraphDSLError(f"serving loop: request {req.request_id!r} needs a token that no step in "
                                    "flight produced (internal error)")
        return out

    def _fill_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, int]]) -> None:
        if not pending:
            return
        idx = to_device(self.device, {"dst": ([a for a, _ in pending], torch.int64),
                                      "src": ([r for _, r in pending], torch.int64)})
        input_ids.index_copy_(0, idx["dst"], self._flight.tokens.index_select(0, idx["src"]))

    # -- decode ------------------------------------------------------------------------------
    def _decode(self, batch: StepBatch):
        reqs = [c.request for c in batch.chunks]
        rows = self._rows
        same = rows is not None and rows.launched and rows.requests == reqs
        if not (same and self._grow_tables(rows, batch.chunks)):   # new rows, or a row outgrew the graph's
            rows = self._rows = self._build_rows(batch)              # block table: a wider graph takes over
        n = len(reqs)
        bufs = rows.bufs
        if rows.graph is not None:
            if rows.lora_slots is not None:
                self._refresh_lora_slots(rows, batch.chunks)
            logits, greedy = rows.graph.replay(n)            # advances the buffers itself (its epilogue)
        else:
            feed = {k: v[:n] for k, v in bufs.items()}
            if any(r.lora is not None for r in reqs):
                feed["lora_indices"] = self._lora_indices(batch.chunks)
            feed["slot_mapping"] = decode_slots(feed["positions"], feed["block_tables"], feed["seq_lens"],
                                                self.executor.block_size)
            logits = self.executor.execute("decode", feed)
            greedy = None
            feed["positions"].add_(1)
            feed["seq_lens"].add_(1)
        rows.launched = True
        return logits, greedy, rows

    def _refresh_lora_slots(self, rows: _Rows, chunks: list[Chunk]) -> None:
        """Ask the slot pool for the rows' adapters every step (host work: it keeps them most
        recently used, and copies one back in if a prefill step evicted it) and rewrite the graph's
        ``lora_indices`` only when a slot moved."""
        slots = self.executor.lora_slots([c.request.lora for c in chunks])
        if slots != rows.lora_slots:
            n = len(slots)
            rows.bufs["lora_indices"][:n].copy_(to_device(self.device, {"l": (slots, torch.int32)})["l"],
                                               non_blocking=True)
            rows.lora_slots = slots

    def _lora_indices(self, chunks: list[Chunk]) -> torch.Tensor:
        """``[num_tokens]`` int32: the LoRA slot of each scheduled token's request (-1: none)."""
        slots = self.executor.lora_slots([c.request.lora for c in chunks])
        per_token = [s for c, s in zip(chunks, slots) for _ in range(c.end - c.start)]
        return to_device(self.device, {"l": (per_token, torch.int32)})["l"]

    def _build_rows(self, batch: StepBatch) -> _Rows:
        reqs = [c.request for c in batch.chunks]
        n = len(reqs)
        ex = self.executor
        lora = any(r.lora is not None for r in reqs)
        blocks = self.scheduler.blocks
        need = max(len(blocks.block_table_array(r.request_id)) for r in reqs)
        graph = ex.decode_graph(n, lora=True, width=need) if lora else ex.decode_graph(n, width=need)
        width = ex.max_blocks_per_seq
        if graph is not None:
            bufs = graph.inputs
            rows_cap, width = graph.rows, graph.width
        else:
            rows_cap = n
            bufs = {"input_ids": torch.zeros(n, dtype=torch.int64, device=self.device),
                    "positions": torch.zeros(n, dtype=torch.int64, device=self.device),
                    "seq_lens": torch.zeros(n, dtype=torch.int32, device=self.device),
                    "block_tables": torch.zeros(n, width, dtype=torch.int32, device=self.device)}
        ids, pos, lens, tables = [], [], [], []
        for c in batch.chunks:
            req = c.request
            ids.append(req.token_ids[c.start] if c.start < req.num_known else 0)
            pos.append(c.start)
            lens.append(c.end)
            t = blocks.block_table_array(req.request_id)
            if len(t) > width:
                raise GraphDSLError(f"serving loop: request {req.request_id!r} holds {len(t)} blocks, more than "
                                    f"the decode block table's width {width} (max_blocks_per_seq="
                                    f"{ex.max_blocks_per_seq})")
            tables.append(t)
        pad = rows_cap - n
        host = to_device(self.device, {"input_ids": (ids + [0] * pad, torch.int64),
                                       "positions": (pos + [0] * pad, torch.int64),
                                       "seq_lens": (lens + [0] * pad, torch.int32),
                                       "block_tables": (padded_rows(tables, width, rows_cap), torch.int32)},
                         shapes={"block_tables": (rows_cap, width)})
        for k in ("input_ids", "positions", "seq_lens", "block_tables"):
            bufs[k].copy_(host[k], non_blocking=True)
        lora_slots = None
        if graph is not None and lora:     # the rows' adapter slots, kept in the graph's buffer (_refresh_lora_slots)
            lora_slots = self.executor.lora_slots([c.request.lora for c in batch.chunks])
            bufs["lora_indices"].copy_(to_device(self.device, {"l": (lora_slots + [-1] * pad, torch.int32)})["l"],
                                       non_blocking=True)
        self._fill_pending(bufs["input_ids"], self._pending_ids(batch))
        st = self._sampling_tensors(reqs)
        return _Rows(reqs, bufs, graph, st, self._ban_table(reqs), lora_slots=lora_slots)

    def _grow_tables(self, rows: _Rows, chunks: list[Chunk]) -> bool:
        """Write the block-table entry of every row whose new token starts a KV block; False (nothing
        written) when such an entry lies past the rows' block table (a narrower graph's)."""
        bs = self.executor.block_size
        blocks = self.scheduler.blocks
        width = rows.bufs["block_tables"].shape[1]
        if any(c.start // bs >= width for c in chunks):
            return False
        r_idx, c_idx, vals = [], [], []
        for r, c in enumerate(chunks):
            if c.start % bs == 0:
                r_idx.append(r)
                c_idx.append(c.start // bs)
                vals.append(blocks.block_table_array(c.request.request_id)[c.start // bs])
        if r_idx:
            idx = to_device(self.device, {"r": (r_idx, torch.int64), "c": (c_idx, torch.int64),
                                          "v": (vals, torch.int32)})
            rows.bufs["block_tables"].index_put_((idx["r"], idx["c"]), idx["v"])
        return True

    # -- prefill -----------------------------------------------------------------------------
    def _prefill(self, batch: StepBatch):
        """Run a step holding prompt chunks eagerly; returns the sampling rows' logits and, per
        request asking for prompt logprobs, its prompt rows' logprob tensors."""
        inputs = batch.model_inputs(self.scheduler.blocks, self.device)
        self._fill_pending(inputs["input_ids"], self._pending_ids(batch))
        want_prompt = [c for c in batch.chunks if c.request.params.prompt_logprobs is not None
                       and c.request.parent is None and c.request.prompt_lp_done < len(c.request.prompt_ids)
                       and c.start < len(c.request.prompt_ids)]
        heads, sample_rows, prompt_spans, at = [], [], [], 0
        for c in batch.chunks:
            width = c.end - c.start
            if c in want_prompt:
                prompt_spans.append((c, len(heads)))
                heads += range(at, at + width)
                if c.samples:
                    sample_rows.append(len(heads) - 1)
            elif c.samples:
                sample_rows.append(len(heads))
                heads.append(at + width - 1)
            at += width
        if want_prompt:
            inputs["lm_head_indices"] = to_device(self.device, {"h": (heads, torch.int64)})["h"]
        if not heads:      # every chunk is a middle piece of a prompt: fill the cache, project one row
            inputs["lm_head_indices"] = torch.zeros(1, dtype=torch.int64, device=self.device)
        if any(c.request.lora is not None for c in batch.chunks):
            inputs["lora_indices"] = self._lora_indices(batch.chunks)
        padded = self.prefill_buckets and set(inputs) - {"lora_indices"} == STANDARD_INPUTS
        if padded:
            inputs, projected = pad_prefill(inputs, self.executor.max_blocks_per_seq, self.scheduler.max_num_seqs)
        logits = self.executor.execute("prefill", inputs, rows=projected if padded else None)
        prompt_rows = []
        for c, row0 in prompt_spans:
            req = c.request
            prompt = req.prompt_ids
            # row row0 + (j - 1 - c.start) predicts prompt token j; score tokens lo..hi not scored before
            # (a recompute after preemption repeats positions already scored)
            lo, hi = max(c.start + 1, req.prompt_lp_done), min(c.end, len(prompt) - 1)
            if hi >= lo:
                part = logits[row0 + lo - 1 - c.start:row0 + hi - c.start]
                nxt = to_device(self.device, {"t": (prompt[lo:hi + 1], torch.int64)})["t"]
                prompt_rows.append((req, lo, compute_logprobs(part, nxt, req.params.prompt_logprobs)))
                req.prompt_lp_done = hi + 1
        if not heads:
            return logits[:0], prompt_rows
        if len(sample_rows) != logits.shape[0]:
            logits = logits[to_device(self.device, {"s": (sample_rows, torch.int64)})["s"]]
        return logits, prompt_rows

    # -- sampling state ----------------------------------------------------------------------
    def _sampling_tensors(self, reqs: list[Request]) -> SamplingTensors:
        return SamplingTensors.build([r.sampling_row or self._sampling_row(r) for r in reqs], self.device)

    def _sampling_row(self, r: Request) -> dict:
        """``r``'s row of :class:`SamplingTensors`, kept on the request until its penalty slot is
        released (its settings and seed do not change while it runs). A temperature below
        ``GREEDY_BELOW`` is greedy (0), and a top-k of the whole vocabulary or more is off (0), as
        the sampler's float32 / int64 columns would otherwise overflow."""
        p = r.params
        top_k = p.top_k if 0 < p.top_k < self.executor.vocab_size else 0
        r.sampling_row = dict(temperature=0.0 if p.greedy else p.temperature, top_k=top_k, top_p=p.top_p, min_p=p.min_p,
                              presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                              repetition_penalty=p.repetition_penalty, seed=r.seed, slot=self._slot(r))
        return r.sampling_row

    def _slot(self, req: Request) -> int:
        """The request's row in the penalty tables (-1 when it uses no penalty); a new slot is
        filled from the request's known tokens (none are pending when it is (re)admitted)."""
        if not req.params.uses_penalties:
            return -1
        slot = self._slots.get(id(req))
        if slot is not None:
            return slot
        if self._penalties is None:
            n = self.scheduler.max_num_seqs
            self._penalties = PenaltyState(n, self.executor.vocab_size, self.device)
            self._free_slots = list(range(n - 1, -1, -1))
        slot = self._free_slots.pop()
        self._slots[id(req)] = slot
        self._penalties.reset(slot, req.prompt_ids, req.output_ids)
        self._slot_owner[slot] = req
        return slot

    def _release_slots(self) -> None:
        """Free the penalty slots of requests no longer running (finished or preempted)."""
        owners = self._slot_owner
        for slot, req in list(owners.items()):
            if req.status is not RequestStatus.RUNNING:
                del owners[slot]
                del self._slots[id(req)]
                req.sampling_row = None
                self._free_slots.append(slot)
                if self._rows is not None and req in self._rows.requests:
                    self._rows = None

    def _ban_ids(self, req: Request) -> list[int]:
        return sorted(set(req.params.stop_token_ids) | (set() if req.params.ignore_eos
                                                        else set(self.scheduler.eos_token_ids)))

    def _ban_table(self, reqs: list[Request]):
        """Device tensors for min_tokens: each row's banned ids (padded with -1), prompt length and
        min_tokens; None when no row has min_tokens."""
        if not any(r.params.min_tokens for r in reqs):
            return None
        ids = [self._ban_ids(r) if r.params.min_tokens else [] for r in reqs]
        width = max(1, max(len(x) for x in ids))
        flat = [t for x in ids for t in x + [-1] * (width - len(x))]
        t = to_device(self.device, {"ids": (flat, torch.int64),
                                    "plen": ([len(r.prompt_ids) for r in reqs], torch.int64),
                                    # capped at max_model_len (all of a request's tokens): the same ban, within int64
                                    "mint": ([min(r.params.min_tokens, self.scheduler.max_model_len) for r in reqs],
                                             torch.int64)},
                      shapes={"ids": (len(reqs), width)})
        return t["ids"], t["plen"], t["mint"]

    def _banned(self, rows: _Rows, positions: torch.Tensor):
        """Banned ids of this decode step: a row's EOS/stop ids while the token it draws (at
        ``positions``) is one of its first ``min_tokens``."""
        if rows.ban is None:
            return None
        ids, plen, mint = rows.ban
        active = (positions - plen) < mint
        return torch.where(active.unsqueeze(1), ids, torch.full_like(ids, -1))

    def _banned_host(self, chunks: list[Chunk]):
        reqs = [c.request for c in chunks]
        if not any(r.params.min_tokens and c.end - len(r.prompt_ids) < r.params.min_tokens
                   for r, c in zip(reqs, chunks)):
            return None
        ids = [self._ban_ids(c.request) if c.end - len(c.request.prompt_ids) < c.request.params.min_tokens else []
               for c in chunks]
        width = max(1, max(len(x) for x in ids))
        flat = [t for x in ids for t in x + [-1] * (width - len(x))]
        return to_device(self.device, {"ids": (flat, torch.int64)}, shapes={"ids": (len(chunks), width)})["ids"]

    # -- collecting --------------------------------------------------------------------------
    def _collect(self, flight: _Flight) -> list[TokenEvent]:
        if flight.event is not None:
            if self._wait is not None:
                self._wait(flight.event)
            else:
                flight.event.synchronize()
        if self._verify is not None:
            self._verify()
        tokens = flight.host.tolist()
        chunks = flight.batch.sampling_chunks
        events = self.scheduler.update(flight.batch, tokens)
        if flight.logprobs is not None:
            top_ids, top_lp, tok_lp, tok_rank = (t.tolist() for t in flight.logprobs)
            alive = {id(e.request): e for e in events}
            for i, c in enumerate(chunks):
                e = alive.get(id(c.request))
                k = c.request.params.logprobs
                if e is not None and k is not None:
                    e.logprobs = self._position(top_ids[i][:k], top_lp[i][:k], tokens[i], tok_lp[i], tok_rank[i])
        for req, first, (top_ids, top_lp, tok_lp, tok_rank) in flight.prompt_rows:
            k = req.params.prompt_logprobs
            ids, lps, tl, tr = top_ids.tolist(), top_lp.tolist(), tok_lp.tolist(), tok_rank.tolist()
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]
            req.prompt_logprobs += [self._position(ids[j][:k], lps[j][:k], req.prompt_ids[first + j], tl[j], tr[j])
                                    for j in range(len(tl))]
        self._recycle(flight)
        return events

    def _position(self, ids, lps, token, token_lp, token_rank) -> dict:
        """One position's logprob dict: the top ``k`` and the chosen token. Every rank is 1 + the
        number of tokens with a strictly larger logprob (outputs.py), so tied tokens share a rank
        and the chosen token's rank does not depend on ``k``: in the descending top list, those
        larger tokens are exactly the entries before the first one tied with it."""
        name = self.decode_name
        out, rank = {}, 0
        for j, (t, lp) in enumerate(zip(ids, lps)):
            if j == 0 or lp < lps[j - 1]:
                rank = j + 1
            out[t] = Logprob(lp, rank, name(t) if name else None)
        if token not in out:
            out[token] = Logprob(token_lp, token_rank, name(token) if name else None)
        return out
