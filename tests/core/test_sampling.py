"""runtime/serving/sampling.py: SamplingParams validation (every field's range named in the error).
The sampler's math is tested in tests/core/test_sampler.py and tests/kernels/test_sampling_kernels.py."""
from __future__ import annotations

import pytest
from graphdsl.errors import GraphDSLError
from graphdsl.runtime.serving.sampling import SamplingParams


# ---------------------------------------------------------------- SamplingParams validation

def test_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (16, 1.0, 0, 1.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.ignore_eos is False
    assert not p.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("field,value,allowed", [
    ("max_tokens", 0, "an integer >= 1"),
    ("temperature", -0.5, "a float >= 0"),
    ("top_k", -2, "an integer >= -1"),
    ("top_p", 0.0, r"a float in \(0, 1\]"),
    ("top_p", 1.5, r"a float in \(0, 1\]"),
    ("repetition_penalty", 0.0, "a float > 0"),
    ("temperature", "hot", "a float >= 0"),
    ("seed", "abc", "an integer or None"),
    ("n", 0, r"an integer >= 1 \(parallel samples"),
    ("min_p", 1.5, r"a float in \[0, 1\]"),
    ("presence_penalty", 2.5, r"a float in \[-2, 2\]"),
    ("frequency_penalty", -3.0, r"a float in \[-2, 2\]"),
    ("logprobs", 21, r"None or an integer in \[0, 20\]"),
    ("prompt_logprobs", -1, r"None or an integer in \[0, 20\]"),
    ("min_tokens", -1, "an integer >= 0 and <= max_tokens"),
])
def test_out_of_range_names_field_range_and_value(field, value, allowed):
    with pytest.raises(GraphDSLError, match=rf"{field} must be {allowed}.*got {value!r}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(GraphDSLError, match=r"min_tokens must be an integer >= 0 and <= max_tokens=4, got 9"):
        SamplingParams(max_tokens=4, min_tokens=9)


def test_new_fields_default_off():
    p = SamplingParams()
    assert (p.n, p.min_p, p.presence_penalty, p.frequency_penalty, p.logprobs, p.prompt_logprobs, p.min_tokens) == \
        (1, 0.0, 0.0, 0.0, None, None, 0)
    assert not p.uses_penalties and SamplingParams(presence_penalty=0.1).uses_penalties


def test_bad_list_entries():
    with pytest.raises(GraphDSLError, match=r"stop_token_ids must be a list of integers >= 0, got \[1, -3\]"):
        SamplingParams(stop_token_ids=[1, -3])
    with pytest.raises(GraphDSLError, match=r"stop must be a list of non-empty strings, got \['a', ''\]"):
        SamplingParams(stop=["a", ""])
    with pytest.raises(GraphDSLError, match=r"stop\[1\] must be a list of non-empty strings, got 5"):
        SamplingParams(stop=["a", 5])


def test_unknown_field_lists_allowed():
    with pytest.raises(GraphDSLError, match=r"unknown field 'topp'; allowed fields: \[.*'top_p'"):
        SamplingParams(topp=0.5)


def test_assignment_is_validated():
    p = SamplingParams()
    p.top_p = 0.5
    assert p.top_p == 0.5
    with pytest.raises(GraphDSLError, match=r"temperature must be a float >= 0.*got -1"):
        p.temperature = -1


def test_model_validate_wraps_errors():
    assert SamplingParams.model_validate({"top_k": 3}).top_k == 3
    with pytest.raises(GraphDSLError, match="top_k must be"):
        SamplingParams.model_validate({"top_k": -7})
