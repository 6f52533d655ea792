"""Sampling parameters and the sampler that turns a batch of logits into next tokens.

Math, applied per row ``i`` of ``logits[n, vocab]`` in this order (HF ``generate`` order):

1. repetition penalty ``r`` (HF ``RepetitionPenaltyLogitsProcessor``): for every token ``t`` seen
   in ``prev_tokens[i]``, ``l_t <- l_t / r`` if ``l_t > 0`` else ``l_t * r``;
2. greedy if ``temperature == 0``: ``argmax_t l_t`` (steps 3-6 skipped);
3. temperature ``T``: ``l <- l / T``;
4. top-k (``k > 0``): drop every token whose logit is below the k-th largest (ties at the k-th
   value are kept, as in HF ``TopKLogitsWarper``);
5. top-p (``p < 1``): ``q = softmax(l)``; sort descending; keep the smallest prefix whose
   cumulative probability is ``>= p`` (token ``j`` is kept iff the mass strictly before it is
   ``< p``, so at least one token is always kept);
6. sample from ``softmax`` over the kept tokens with the row's own ``torch.Generator`` (or the
   global RNG when None), so a request with a seed reproduces regardless of its batch
   (exponential race: ``argmax p_t / E_t``, ``E_t ~ Exp(1)``).

:class:`SamplingParams` validates every field; a bad value raises :class:`GraphDSLError` naming
the field, the allowed range and the value.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from graphdsl.errors import GraphDSLError

__all__ = ["SamplingParams", "sample", "sampling_probs", "apply_repetition_penalty",
           "make_generator"]

# Readable allowed ranges, used in error messages (pydantic's own constraints enforce them).
_ALLOWED = {
    "max_tokens": "an integer >= 1",
    "temperature": "a float >= 0 (0 = greedy)",
    "top_k": "an integer >= -1 (0 or -1 = off)",
    "top_p": "a float in (0, 1] (1 = off)",
    "repetition_penalty": "a float > 0 (1 = off)",
    "stop": "a list of non-empty strings",
    "stop_token_ids": "a list of integers >= 0",
    "seed": "an integer or None",
    "ignore_eos": "a bool",
}


def _readable(e: ValidationError) -> GraphDSLError:
    lines = []
    for err in e.errors():
        loc = err.get("loc", ())
        field = str(loc[0]) if loc else "?"
        where = field + "".join(f"[{p}]" for p in loc[1:])
        if err.get("type") == "extra_forbidden":
            lines.append(f"unknown field {field!r}; allowed fields: {sorted(_ALLOWED)}")
            continue
        allowed = _ALLOWED.get(field, err.get("msg", ""))
        lines.append(f"{where} must be {allowed}, got {err.get('input')!r}")
    return GraphDSLError("invalid SamplingParams: " + "; ".join(lines))


class SamplingParams(BaseModel):
    """Per-request generation settings (validated on construction and on assignment)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _readable(e) from None
        if any(s == "" for s in self.stop):
            raise GraphDSLError(f"invalid SamplingParams: stop must be {_ALLOWED['stop']}, "
                                f"got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise GraphDSLError(f"invalid SamplingParams: stop_token_ids must be "
                                f"{_ALLOWED['stop_token_ids']}, got {self.stop_token_ids!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise _readable(e) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "SamplingParams":
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise GraphDSLError(f"SamplingParams.model_validate expects a dict, got {obj!r}")
        return cls(**obj)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with ``params.seed`` on ``device`` (None when no seed is set)."""
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def apply_repetition_penalty(logits: torch.Tensor, penalties: list[float],
                             prev_tokens: list[list[int]]) -> torch.Tensor:
    """HF-style repetition penalty, in place on ``logits[n, vocab]``; returns ``logits``.

    All penalised rows are done in one gather/scatter over flat indices ``row·vocab + token``
    (a token seen twice is written twice with the same value).
    """
    n, vocab = logits.shape
    rows = [i for i, (r, toks) in enumerate(zip(penalties, prev_tokens)) if r != 1.0 and toks]
    if not rows:
        return logits
    lens = torch.tensor([len(prev_tokens[i]) for i in rows])
    total = int(lens.sum())
    toks = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(prev_tokens[i] for i in rows),
                                        dtype=np.int64, count=total))
    bad = (toks < 0) | (toks >= vocab)
    if bool(bad.any()):
        owner = torch.tensor(rows).repeat_interleave(lens)[bad]
        i = int(owner[0])
        ids = [t for t in prev_tokens[i] if not 0 <= t < vocab]
        raise GraphDSLError(f"prev_tokens[{i}] holds ids outside [0, {vocab}): {ids[:8]}")
    row_of = torch.tensor(rows).repeat_interleave(lens)
    r = torch.tensor([float(penalties[i]) for i in rows]).repeat_interleave(lens)
    dev = logits.device
    flat_idx = (row_of * vocab + toks).to(dev, non_blocking=True)
    r = r.to(dev, non_blocking=True)
    flat = logits.view(-1)
    seen = flat.index_select(0, flat_idx)
    flat.index_copy_(0, flat_idx, torch.where(seen > 0, seen / r, seen * r))
    return logits


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams],
                   prev_tokens: list[list[int]]) -> torch.Tensor:
    """The distribution each non-greedy row samples from (steps 1 and 3-5), float32 ``[n, vocab]``.

    Greedy rows get a one-hot at their argmax.
    """
    _check_batch(logits, params, None, prev_tokens)
    logits = logits.to(torch.float32).contiguous().clone()
    n, vocab = logits.shape
    dev = logits.device
    apply_repetition_penalty(logits, [p.repetition_penalty for p in params], prev_tokens)

    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    table = torch.tensor([[1.0 if p.greedy else p.temperature, k, p.top_p, p.greedy]
                          for p, k in zip(params, ks)], dtype=torch.float32).to(dev, non_blocking=True)
    temps, k, top_p, greedy = table[:, 0:1], table[:, 1:2].long(), table[:, 2:3], table[:, 3] > 0
    logits = logits / temps

    use_k = any(kk < vocab for kk in ks)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k:
        kth = logits.topk(max(ks), dim=1).values.gather(1, k - 1)   # only the largest k_max
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if use_p:
        if all(kk < vocab for kk, p in zip(ks, params) if p.top_p < 1.0):
            # every top-p row is already cut to its top k (plus ties): sort only the survivors
            width = int((logits > float("-inf")).sum(dim=1).max())
            vals, order = logits.topk(width, dim=1)
        else:
            vals, order = logits.sort(dim=1, descending=True)
        probs_sorted = vals.softmax(dim=1)
        mass_before = probs_sorted.cumsum(dim=1) - probs_sorted
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        logits = logits.scatter(1, order, vals.masked_fill(drop_sorted, float("-inf")))

    probs = logits.softmax(dim=1)
    if any(p.greedy for p in params):
        onehot = torch.zeros_like(probs).scatter(1, logits.argmax(dim=1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           prev_tokens: list[list[int]]) -> torch.Tensor:
    """Next token per row of ``logits[n, vocab]`` (float32) -> ``int64[n]`` on logits' device.

    ``generators[i]`` (on logits' device, or None for the global RNG) drives row ``i``'s draw;
    ``prev_tokens[i]`` are the prompt + generated ids the repetition penalty looks at.

    The draw is an exponential race, ``argmax_t p_t / E_t`` with ``E_t ~ Exp(1)`` i.i.d., which
    picks ``t`` with probability ``p_t``: one noise kernel for all unseeded rows, one per seeded
    row (its own generator), and no host synchronisation.
    """
    _check_batch(logits, params, generators, prev_tokens)
    probs = sampling_probs(logits, params, prev_tokens)
    if all(p.greedy for p in params):
        return probs.argmax(dim=1).to(torch.int64)
    noise = torch.empty_like(probs).exponential_()
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy and g is not None:
            noise[i].exponential_(generator=g)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=1).to(torch.int64)


def _check_batch(logits, params, generators, prev_tokens) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise GraphDSLError(f"sample: logits must be a 2-D tensor [n, vocab], got {shape}")
    n = logits.shape[0]
    lens = {"params": len(params), "prev_tokens": len(prev_tokens)}
    if generators is not None:
        lens["generators"] = len(generators)
    wrong = {k: v for k, v in lens.items() if v != n}
    if wrong:
        raise GraphDSLError(f"sample: params, generators and prev_tokens must each have one entry "
                            f"per logits row ({n}), got lengths {wrong}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise GraphDSLError(f"sample: params[{i}] must be a SamplingParams, got {type(p).__name__}")
