"""The sampler: a batch of logits to next tokens, on the logits' device, with no host sync.

Per row ``r`` of ``logits[R, V]`` (float32), in this order:

1. ``banned`` ids get ``-inf`` (``min_tokens`` keeps EOS and stop ids out);
2. repetition penalty ``rho`` (HF): every token seen in the prompt or generated
   (``prompt_mask | counts > 0``) gets ``l / rho`` if ``l > 0`` else ``l * rho``;
3. OpenAI penalties over generated tokens: ``l -= frequency * count + presence * [count > 0]``;
4. ``temperature == 0``: greedy, ``argmax l`` (lowest id on ties); steps 5-8 are skipped;
5. ``x = l / temperature``;
6. min-p: keep ``x >= max x + log(min_p)`` (``p_t >= min_p * p_max``);
7. top-k: keep ``x >=`` the k-th largest ``x`` (ties at the k-th value kept);
8. top-p over what 6-7 kept: keep token ``t`` iff the probability mass of the kept tokens with a
   *strictly larger* ``x`` is ``< top_p`` of the kept mass (so tied tokens are kept or cut
   together, and at least the most likely token is kept). With a top-k, the mass counts the k
   largest and at most :data:`TIES_COUNTED` more tied with the k-th (a row's result never depends
   on other rows' k);
9. draw: Gumbel-max over the kept tokens with counter-based noise of (seed, position, token)
   (:mod:`graphdsl.runtime.kernels.sampling`): a request's tokens depend only on its seed, its
   logits and its positions, never on its batch neighbours.

Steps 6-8 come down to one threshold per row (keep ``x >= thr``), computed from a sorted prefix:
each row's ``max top-k + TIES_COUNTED`` largest values (no full-vocabulary sort), or the whole
sorted row only when a row asks for top-p without a top-k of at most :data:`TOPK_SORT_LIMIT`.
On CUDA, a batch whose sampled rows all have a top-k (prefix width at most
``kernels.topk_draw.MAX_WIDTH``) runs steps 2-9 in two Triton launches
(:mod:`graphdsl.runtime.kernels.topk_draw`: each slice's largest values by a bitwise search, then
per row the threshold and the draw over those candidates); other batches take ``torch.topk`` (or
the sort) for the prefix and the kernels of :mod:`graphdsl.runtime.kernels.sampling` for
penalties + temperature, the threshold and the draw. On the CPU the same math runs in torch
(bit-identical noise). (A Triton replacement of ``torch.topk`` that sorted 8192-token chunks with
``tl.sort`` was slower on an H100: 183 against ~60 µs a row.)

Penalties read :class:`PenaltyState`: per request slot, the count of each generated token and a
mask of prompt tokens, kept on the device (``record`` adds each step's tokens).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from graphdsl.errors import GraphDSLError

from .scheduler import to_device

__all__ = ["SamplingTensors", "PenaltyState", "sample", "sample_reference", "compute_logprobs",
           "compute_logprobs_reference", "TOPK_SORT_LIMIT",
           "TIES_COUNTED"]

TOPK_SORT_LIMIT = 1024   # top-p rows with a top-k up to this use the top-k prefix, not a full sort
TIES_COUNTED = 64        # tokens tied with the k-th value beyond it that count in the top-p mass
TOPK_DRAW = True         # batches whose sampled rows all have a top-k: kernels.topk_draw (two launches)

_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed", "slot")
_FIELDS = _FLOATS + _INTS
_ROW = operator.itemgetter(*_FIELDS)


@dataclass
class SamplingTensors:
    """Per-row settings on the sampling device, each ``[R]``, and host-side summaries of them."""

    temperature: torch.Tensor        # float32; 0 => greedy row
    top_k: torch.Tensor              # int64; 0 => off
    top_p: torch.Tensor              # float32 in (0, 1]; 1 => off
    min_p: torch.Tensor              # float32 in [0, 1]; 0 => off
    presence_penalty: torch.Tensor   # float32; 0 => off
    frequency_penalty: torch.Tensor  # float32; 0 => off
    repetition_penalty: torch.Tensor  # float32; 1 => off
    seed: torch.Tensor               # int64
    slot: torch.Tensor               # int64 row in PenaltyState, -1 => no penalty
    all_greedy: bool = True
    any_penalty: bool = False
    max_top_k: int = 0
    any_top_p: bool = False
    any_min_p: bool = False
    any_greedy: bool = True
    full_sort: bool = False          # some top-p row has no top-k <= TOPK_SORT_LIMIT
    all_top_k: bool = False          # every sampled row has a top-k (the two-launch draw applies)

    @classmethod
    def build(cls, rows: list[dict], device) -> "SamplingTensors":
        """``rows[i]``: temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty,
        repetition_penalty, seed, slot. One host-to-device copy (:func:`.scheduler.to_device`);
        the rows are read into columns in C (``itemgetter``), since the loop builds these for up
        to hundreds of rows a step."""
        device = torch.device(device)
        missing = [k for k in _FIELDS if rows and k not in rows[0]]
        if missing:
            raise GraphDSLError(f"SamplingTensors.build: rows need the keys {missing}")
        cols = dict(zip(_FIELDS, zip(*map(_ROW, rows)))) if rows else {k: () for k in _FIELDS}
        t = to_device(device, {**{k: (cols[k], torch.float32) for k in _FLOATS},
                               **{k: (cols[k], torch.int64) for k in _INTS}})
        temps = cols["temperature"]
        flags = dict(all_greedy=max(temps, default=0) <= 0, any_greedy=min(temps, default=1) <= 0,
                     any_penalty=max(cols["slot"], default=-1) >= 0)
        if not flags["all_greedy"]:
            sampled = [(k, p, m) for temp, k, p, m in zip(temps, cols["top_k"], cols["top_p"], cols["min_p"])
                       if temp > 0]
            flags.update(max_top_k=max((int(k) for k, _, _ in sampled if k > 0), default=0),
                         any_top_p=any(p < 1.0 for _, p, _ in sampled), any_min_p=any(m > 0 for _, _, m in sampled),
                         full_sort=any(p < 1.0 and not 0 < k <= TOPK_SORT_LIMIT for k, p, _ in sampled),
                         all_top_k=all(k > 0 for k, _, _ in sampled))
        return cls(**t, **flags)


class PenaltyState:
    """``counts[num_slots, vocab]`` int32 (generated tokens of the slot's request) and
    ``prompt_mask[num_slots, vocab]`` bool (tokens of its prompt), on the device."""

    def __init__(self, num_slots: int, vocab: int, device):
        self.device = torch.device(device)
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(num_slots, vocab, dtype=torch.bool, device=self.device)

    def reset(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Overwrite the slot's rows from host token lists (no host sync)."""
        if not 0 <= slot < self.counts.shape[0]:
            raise GraphDSLError(f"PenaltyState.reset: slot must be in [0, {self.counts.shape[0]}), got {slot}")
        ids = to_device(self.device, {"ids": (prompt_ids + output_ids, torch.int64)})["ids"]
        self.counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot].index_fill_(0, ids[:len(prompt_ids)], True)
        if output_ids:
            out = ids[len(prompt_ids):]
            self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """``counts[slots[r], tokens[r]] += 1`` for rows with ``slots[r] >= 0`` (device only)."""
        self.counts.index_put_((slots.clamp(min=0), tokens), (slots >= 0).to(torch.int32), accumulate=True)


_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(logits, st, counters, banned) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        got = (tuple(logits.shape), logits.dtype) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise GraphDSLError(f"sample: logits must be a float32, bfloat16 or float16 [R, vocab] tensor, got {got}")
    R = logits.shape[0]
    if st.temperature.shape != (R,):
        raise GraphDSLError(f"sample: the SamplingTensors hold {st.temperature.shape[0]} rows, logits {R}")
    if counters.shape != (R,) or counters.dtype != torch.int64:
        raise GraphDSLError(f"sample: counters must be int64 [{R}], got {counters.dtype} {list(counters.shape)}")
    if banned is not None and (banned.dim() != 2 or banned.shape[0] != R or banned.dtype != torch.int64):
        raise GraphDSLError(f"sample: banned must be int64 [{R}, B], got {banned.dtype} {list(banned.shape)}")


def _penalized(l: torch.Tensor, st: SamplingTensors, penalties: PenaltyState | None) -> torch.Tensor:
    """Steps 2-3 in torch."""
    if penalties is None:
        return l
    has = (st.slot >= 0)[:, None]
    s = st.slot.clamp(min=0)
    cnt = penalties.counts.index_select(0, s)
    seen = penalties.prompt_mask.index_select(0, s) | (cnt > 0)
    rho = st.repetition_penalty[:, None]
    l = torch.where(has & seen, torch.where(l > 0, l / rho, l * rho), l)
    return l - has * (st.frequency_penalty[:, None] * cnt.to(torch.float32) + st.presence_penalty[:, None] * (cnt > 0))


def _prefix(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor | None:
    """The sorted prefix steps 6-8 read: each row's largest ``max_top_k + TIES_COUNTED`` values
    (``torch.topk``), or the whole sorted row when a top-p row has no small top-k; None when no
    row uses top-k or top-p."""
    if not (st.max_top_k or st.any_top_p):
        return None
    if st.full_sort:
        return x.sort(dim=1, descending=True).values
    return x.topk(min(st.max_top_k + TIES_COUNTED, x.shape[1]), dim=1).values


def _prefix_threshold(vals: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Steps 6-8 from the sorted prefix, in torch (what ``kernels.sampling.threshold`` computes)."""
    R, W = vals.shape
    neg = torch.full((R,), float("-inf"), dtype=torch.float32, device=vals.device)
    m = vals[:, 0]
    thr = torch.where(st.min_p > 0, m + torch.log(st.min_p.clamp(min=1e-30)), neg)
    k = st.top_k
    kth = vals.gather(1, (k - 1).clamp(0, W - 1)[:, None]).squeeze(1)
    thr = torch.where((k > 0) & (k <= W), torch.maximum(thr, kth), thr)
    j = torch.arange(W, device=vals.device)[None, :]
    limit = torch.where(k > 0, k + TIES_COUNTED, torch.full_like(k, W))[:, None]
    kept = (vals >= thr[:, None]) & (j < limit)
    e = torch.where(kept, torch.exp(vals - m[:, None]), torch.zeros_like(vals))
    c = e.cumsum(dim=1) - e
    z = e.sum(dim=1, keepdim=True)
    J = (kept & (c < st.top_p[:, None] * z)).sum(dim=1)
    t_p = vals.gather(1, (J - 1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(st.top_p < 1.0, torch.maximum(thr, t_p), thr)


def _threshold(x: torch.Tensor, st: SamplingTensors, kernel=None) -> torch.Tensor:
    """Steps 6-8 as one threshold per row: keep ``x >= thr`` (``-inf`` keeps everything)."""
    vals = _prefix(x, st)
    if vals is None:
        neg = torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)
        if not st.any_min_p:
            return neg
        return torch.where(st.min_p > 0, x.max(dim=1).values + torch.log(st.min_p.clamp(min=1e-30)), neg)
    if kernel is not None and vals.shape[1] <= 4096:
        return kernel(vals.contiguous(), st.min_p, st.top_k, st.top_p, TIES_COUNTED)
    return _prefix_threshold(vals, st)


def _sample(logits, st, counters, penalties, banned, cuda: bool, record: bool = False, into=None) -> torch.Tensor:
    _check(logits, st, counters, banned)
    l = logits
    if banned is not None:
        hits = torch.zeros(l.shape, dtype=torch.int32, device=l.device)
        hits.scatter_add_(1, banned.clamp(min=0), (banned >= 0).to(torch.int32))   # pads (-1) add 0
        l = l.masked_fill_(hits > 0, float("-inf"))
    use_pen = penalties is not None and st.any_penalty
    record = record and use_pen
    from graphdsl.runtime.kernels import sampling as K, topk_draw
    if cuda:
        extra = dict(ids=into, record=(st.slot, penalties.counts) if record else None)
        if st.all_greedy and not use_pen:    # nothing to penalise or scale: the argmax of the logits as they are
            return K.argmax(l, **extra)
        width = min(st.max_top_k + TIES_COUNTED, l.shape[1])
        if TOPK_DRAW and st.all_top_k and width <= topk_draw.MAX_WIDTH:
            return topk_draw.draw_top_k(l, st.temperature, st.slot, st.repetition_penalty, st.presence_penalty,
                                        st.frequency_penalty, penalties.counts if use_pen else None,
                                        penalties.prompt_mask if use_pen else None, width, st.min_p, st.top_k,
                                        st.top_p, TIES_COUNTED, st.seed, counters, mixed=st.any_greedy, **extra)
        x = K.penalize(l, st.temperature, st.slot, st.repetition_penalty, st.presence_penalty, st.frequency_penalty,
                       penalties.counts if use_pen else None, penalties.prompt_mask if use_pen else None)
        if st.all_greedy:                    # greedy rows are not divided by their temperature
            return K.argmax(x, **extra)
        return K.gumbel_argmax(x, _threshold(x, st, K.threshold), st.seed, counters,
                               temperature=st.temperature if st.any_greedy else None, **extra)
    l = _penalized(l.float(), st, penalties if use_pen else None)
    temp = st.temperature
    x = l / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    if st.all_greedy:
        tokens = x.argmax(dim=1)
    else:
        tokens = K.gumbel_argmax_reference(x, _threshold(x, st), st.seed, counters)
        if st.any_greedy:
            tokens = torch.where(st.temperature > 0, tokens, x.argmax(dim=1))
    if record:
        penalties.record(st.slot, tokens)
    if into is not None:
        into.copy_(tokens)
    return tokens


def sample(logits: torch.Tensor, st: SamplingTensors, counters: torch.Tensor, *,
           penalties: PenaltyState | None = None, banned: torch.Tensor | None = None, record: bool = False,
           into: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row (module docstring), int64 ``[R]`` on logits' device; ``logits`` (float32,
    or a decode graph's logits in the model's 16-bit dtype, read as their exact float32 cast) may
    be changed in place. ``counters[r]`` is the position of the token being drawn; ``banned`` int64
    ``[R, B]`` (ids >= 0 are banned, -1 pads). ``record``: also count the drawn tokens in
    ``penalties`` (:meth:`PenaltyState.record`); ``into``: int64 ``[R]`` that also receives them (the
    next decode step's ``input_ids``). No host synchronisation. On CUDA: rows that all have a
    top-k (or are greedy) take the two launches of :mod:`graphdsl.runtime.kernels.topk_draw`; other
    batches the Triton kernels of :mod:`graphdsl.runtime.kernels.sampling` (penalties + temperature
    in one launch, ``torch.topk`` of the batch's largest k, the threshold, the draw in two
    launches); the last launch also does ``record`` and ``into``. Elsewhere the torch path."""
    return _sample(logits, st, counters, penalties, banned, logits.device.type == "cuda", record, into)


def sample_reference(logits: torch.Tensor, st: SamplingTensors, counters: torch.Tensor, *,
                     penalties: PenaltyState | None = None, banned: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sample` in plain torch on any device (the CPU path, and the kernels' reference)."""
    return _sample(logits, st, counters, penalties, banned, False)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num: int):
    """Raw logprobs (``log_softmax`` of ``logits`` in float32): ``(top_ids int64 [R, num],
    top_logprobs float32 [R, num] descending, token_logprob float32 [R], token_rank int64 [R])``,
    rank = 1 + the number of entries with a strictly larger logprob. No host sync: on CUDA one
    Triton launch (:mod:`graphdsl.runtime.kernels.logprobs`, ``num <= 64``; ties in the top list go
    to the lowest id), elsewhere :func:`compute_logprobs_reference`."""
    if logits.device.type == "cuda" and logits.dim() == 2 and logits.shape[1] > 0:
        from graphdsl.runtime.kernels.logprobs import MAX_NUM, logprobs
        if num <= min(MAX_NUM, logits.shape[1]):
            return logprobs(logits.to(torch.float32).contiguous(), tokens.to(torch.int64).contiguous(), num)
    return compute_logprobs_reference(logits, tokens, num)


def compute_logprobs_reference(logits: torch.Tensor, tokens: torch.Tensor, num: int):
    """:func:`compute_logprobs` in plain torch (``log_softmax``, ``topk``), on any device."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=1)
    tok = lp.gather(1, tokens[:, None])
    rank = (lp > tok).sum(dim=1) + 1
    if num:
        top = lp.topk(num, dim=1)
        return top.indices, top.values, tok.squeeze(1), rank
    R = lp.shape[0]
    return (torch.empty(R, 0, dtype=torch.int64, device=lp.device), torch.empty(R, 0, device=lp.device),
            tok.squeeze(1), rank)
