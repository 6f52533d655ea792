"""``SamplingParams``: per-request generation settings, shaped like vLLM's.

Every field is validated on construction and on assignment; a bad value raises
:class:`GraphDSLError` naming the field, the allowed range and the value. The math these settings
select (penalties, temperature, min-p, top-k, top-p, the seeded draw) is in
:mod:`graphdsl.runtime.serving.sampler`, which runs it on the device.

``n`` parallel samples share the prompt's KV blocks; sample ``i`` of a seeded request draws with
``seed + i``. ``logprobs`` / ``prompt_logprobs`` ask for the top-N raw logprobs per generated /
prompt token (:mod:`graphdsl.runtime.serving.outputs`). ``min_tokens`` keeps EOS and
``stop_token_ids`` from being drawn, and stop strings from matching, before that many tokens.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from graphdsl.errors import GraphDSLError

__all__ = ["SamplingParams", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20        # the most top logprobs a request may ask for (vLLM's and OpenAI's cap)

# Readable allowed ranges, used in error messages (pydantic's own constraints enforce them).
_ALLOWED = {
    "n": "an integer >= 1 (parallel samples of one prompt)",
    "max_tokens": "an integer >= 1",
    "min_tokens": "an integer >= 0 and <= max_tokens",
    "temperature": "a float >= 0 (0 = greedy)",
    "top_k": "an integer >= -1 (0 or -1 = off)",
    "top_p": "a float in (0, 1] (1 = off)",
    "min_p": "a float in [0, 1] (0 = off)",
    "repetition_penalty": "a float > 0 (1 = off)",
    "presence_penalty": "a float in [-2, 2] (0 = off)",
    "frequency_penalty": "a float in [-2, 2] (0 = off)",
    "logprobs": f"None or an integer in [0, {MAX_LOGPROBS}] (top logprobs per generated token)",
    "prompt_logprobs": f"None or an integer in [0, {MAX_LOGPROBS}] (top logprobs per prompt token)",
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

    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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
        if self.min_tokens > self.max_tokens:
            raise GraphDSLError(f"invalid SamplingParams: min_tokens must be {_ALLOWED['min_tokens']}"
                                f"={self.max_tokens}, got {self.min_tokens}")

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

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the request's earlier tokens (any of the three penalties is on)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
