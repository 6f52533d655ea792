"""``SamplingParams``: per-request generation settings, shaped like vLLM's.

Every field is validated on construction and on assignment, the checks between fields
(``min_tokens <= max_tokens``, the seed range for ``n`` samples) included; a bad value raises
:class:`GraphDSLError` naming the field, the allowed range and the value, and a refused assignment
leaves the object as it was. Types are strict: integer fields take ``int`` only (not ``bool``,
``str`` or ``float``), float fields take finite ``int`` or ``float`` (not ``bool`` or ``str``),
``ignore_eos`` takes a ``bool``, and ``stop`` / ``stop_token_ids`` take a list or tuple of
``str`` / ``int``; a single ``stop`` string (as vLLM accepts) is stored as a one-element list, and
None (vLLM's default for both) as an empty one. A ``temperature`` below :data:`GREEDY_BELOW` is
greedy, as in vLLM (dividing logits by it would overflow float32). The
math these settings select (penalties, temperature, min-p, top-k, top-p, the seeded draw) is in
:mod:`graphdsl.runtime.serving.sampler`, which runs it on the device.

``n`` parallel samples share the prompt's KV blocks; sample ``i`` of a seeded request draws with
``seed + i``, and the sampler keeps seeds as int64, so ``seed`` and ``seed + n - 1`` must both fit
one. ``logprobs`` / ``prompt_logprobs`` ask for the top-N raw logprobs per generated / prompt token
(:mod:`graphdsl.runtime.serving.outputs`). ``min_tokens`` keeps EOS and ``stop_token_ids`` from
being drawn, and stop strings from matching, before that many tokens.
"""
from __future__ import annotations

from typing import Any

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from graphdsl.errors import GraphDSLError

__all__ = ["SamplingParams", "MAX_LOGPROBS", "GREEDY_BELOW"]

MAX_LOGPROBS = 20        # the most top logprobs a request may ask for (vLLM's and OpenAI's cap)
GREEDY_BELOW = 1e-5      # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
_SEED_MIN, _SEED_MAX = -2**63, 2**63 - 1     # the sampler's seeds are int64

# Readable allowed ranges, used in error messages (pydantic's own constraints enforce them).
_ALLOWED = {
    "n": "an integer >= 1 (parallel samples of one prompt)",
    "max_tokens": "an integer >= 1, or None (as many as max_model_len leaves room for)",
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
    "seed": "an integer or None, with -2**63 <= seed and seed + n - 1 <= 2**63 - 1 "
            "(sample i of n draws with seed + i, an int64)",
    "ignore_eos": "a bool",
}


def _readable(e: ValidationError) -> GraphDSLError:
    lines = []
    for err in e.errors():
        loc = err.get("loc", ())
        if not loc:                    # a check between fields: its message is already written out
            lines.append(str(err.get("ctx", {}).get("error", err.get("msg", ""))))
            continue
        field = str(loc[0])
        where = field + "".join(f"[{p}]" for p in loc[1:])
        if err.get("type") == "extra_forbidden":
            lines.append(f"unknown field {field!r}; allowed fields: {sorted(_ALLOWED)}")
            continue
        allowed = _ALLOWED.get(field, err.get("msg", ""))
        why = " (floats must be finite)" if err.get("type") == "finite_number" else ""
        lines.append(f"{where} must be {allowed}, got {err.get('input')!r}{why}")
    return GraphDSLError("invalid SamplingParams: " + "; ".join(lines))


class SamplingParams(BaseModel):
    """Per-request generation settings (validated, strictly typed, on construction and on assignment)."""

    # strict: no coercion (a bool is no int, a str no number, 0 or 1 no bool); an int is taken for a float.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(16, ge=1)
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

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_"):
            # Check a whole new object first, so a refused value is never stored: pydantic's own
            # assignment stores the value before the checks between fields run, and keeps it if they fail.
            type(self)(**{**self.__dict__, name: value})
        super().__setattr__(name, value)

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _as_list(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:                   # vLLM's default: no stop strings / ids
            return []
        if info.field_name == "stop" and isinstance(value, str):
            return [value]
        return list(value) if isinstance(value, tuple) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("an empty stop string")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _no_negative_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("a negative token id")
        return value

    @model_validator(mode="after")
    def _between_fields(self) -> "SamplingParams":
        problems = []
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens must be {_ALLOWED['min_tokens']}={self.max_tokens}, got {self.min_tokens}")
        if self.seed is not None and not (_SEED_MIN <= self.seed and self.seed + self.n - 1 <= _SEED_MAX):
            problems.append(f"seed must be {_ALLOWED['seed']}, got {self.seed} with n={self.n}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "SamplingParams":
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise GraphDSLError(f"SamplingParams.model_validate expects a dict, got {obj!r}")
        return cls(**obj)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes, **kwargs: Any) -> "SamplingParams":
        """From a JSON object's text, validated as the constructor validates (same errors)."""
        import json
        try:
            obj = json.loads(json_data)
        except (TypeError, ValueError) as e:
            raise GraphDSLError(f"SamplingParams.model_validate_json expects a JSON object's text, got "
                                f"{json_data!r:.80} ({e})") from None
        return cls.model_validate(obj)

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax: ``temperature`` below :data:`GREEDY_BELOW` (vLLM's rule)."""
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the request's earlier tokens (any of the three penalties is on)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
