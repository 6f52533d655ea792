"""What a request hands back, shaped like vLLM's outputs.

A :class:`RequestOutput` is one prompt: its text and ids, its ``prompt_logprobs`` when asked for,
and ``outputs`` — one :class:`CompletionOutput` per parallel sample (``SamplingParams.n``), each
with its text, token ids, ``cumulative_logprob`` and per-token ``logprobs`` when asked for.

Logprobs are the model's raw distribution, ``log_softmax(logits)`` in float32 before any penalty,
temperature or truncation (vLLM's default ``raw_logprobs``). Each position holds a dict
``token id -> Logprob``: the ``k`` most likely tokens plus the chosen token (so ``k`` or ``k + 1``
entries); ``rank`` is 1 + the number of vocabulary entries with a strictly larger logprob.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Logprob", "CompletionOutput", "RequestOutput", "PositionLogprobs"]


@dataclass
class Logprob:
    """One token's log-probability at one position."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request. ``finish_reason``: ``"stop"`` (EOS, a stop token or a stop string),
    ``"length"`` (``max_tokens`` or ``max_model_len``), ``"abort"``, or None while running;
    ``stop_reason`` is the stop string or stop token id that ended it (None for EOS or length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result: ``outputs`` holds ``n`` samples, ordered by index. ``prompt_logprobs``
    has one entry per prompt token, None for the first (nothing predicts it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
