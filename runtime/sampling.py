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
   global RNG when None), so a request with a seed reproduces regardless of its batch.

:class:`SamplingParams` validates every field; a bad value raises :class:`GraphDSLError` naming
the field, the allowed range and the value.
"""
from __future__ import annotations

from typing import Any

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
    """HF-style repetition penalty, in place on ``logits[n, vocab]``; returns ``logits``."""
    vocab = logits.shape[1]
    for i, (r, toks) in enumerate(zip(penalties, prev_tokens)):
        if r == 1.0 or not toks:
            continue
        bad = [t for t in toks if not 0 <= t < vocab]
        if bad:
            raise GraphDSLError(f"prev_tokens[{i}] holds ids outside [0, {vocab}): {bad[:8]}")
        idx = torch.tensor(sorted(set(toks)), dtype=torch.long, device=logits.device)
        row = logits[i]
        seen = row.index_select(0, idx)
        row.index_copy_(0, idx, torch.where(seen > 0, seen / r, seen * r))
    return logits


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams],
                   prev_tokens: list[list[int]]) -> torch.Tensor:
    """The distribution each non-greedy row samples from (steps 1 and 3-5), float32 ``[n, vocab]``.

    Greedy rows get a one-hot at their argmax.
    """
    _check_batch(logits, params, None, prev_tokens)
    logits = logits.to(torch.float32).clone()
    n, vocab = logits.shape
    apply_repetition_penalty(logits, [p.repetition_penalty for p in params], prev_tokens)

    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                         dtype=torch.float32, device=logits.device)
    logits = logits / temps[:, None]

    ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    ps = [p.top_p for p in params]
    if any(k < vocab for k in ks):
        k = torch.tensor([min(k, vocab) for k in ks], device=logits.device)
        top = logits.topk(int(k.max()), dim=1).values          # only the largest k_max per row
        kth = top.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in ps):
        p = torch.tensor(ps, dtype=torch.float32, device=logits.device)
        probs_sorted, order = logits.softmax(dim=1).sort(dim=1, descending=True)
        mass_before = probs_sorted.cumsum(dim=1) - probs_sorted
        drop_sorted = mass_before >= p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))

    probs = logits.softmax(dim=1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter(1, logits.argmax(dim=1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           prev_tokens: list[list[int]]) -> torch.Tensor:
    """Next token per row of ``logits[n, vocab]`` (float32) -> ``int64[n]`` on logits' device.

    ``generators[i]`` (on logits' device, or None for the global RNG) drives row ``i``'s draw;
    ``prev_tokens[i]`` are the prompt + generated ids the repetition penalty looks at.
    """
    _check_batch(logits, params, generators, prev_tokens)
    probs = sampling_probs(logits, params, prev_tokens)
    out = probs.argmax(dim=1)
    # rows on the global RNG are drawn in one call; seeded rows each with their own generator
    shared = [i for i, (p, g) in enumerate(zip(params, generators)) if not p.greedy and g is None]
    if shared:
        idx = torch.tensor(shared, device=probs.device)
        out[idx] = torch.multinomial(probs[idx], 1)[:, 0]
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy and g is not None:
            out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return out.to(torch.int64)


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
