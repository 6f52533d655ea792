"""runtime/serving/sampling.py: SamplingParams is strict. Seeds fit the sampler's int64 for all ``n``
samples, a single ``stop`` string is taken, every check (the ones between fields too) runs on
assignment and a refused assignment changes nothing, types are not coerced, and floats are finite.
The range-per-field errors are tested in tests/core/test_sampling.py."""
from __future__ import annotations

import re

import pytest

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.serving.kv_cache import BlockManager
from graphdsl.runtime.serving.loop import ServingLoop
from graphdsl.runtime.serving.sampling import SamplingParams
from graphdsl.runtime.serving.scheduler import RequestStatus, Scheduler
from tests.helpers.fake_model import FakeModel

I64_MIN, I64_MAX = -2**63, 2**63 - 1
SEED_RANGE = r"seed must be an integer or None, with -2\*\*63 <= seed and seed \+ n - 1 <= 2\*\*63 - 1"


# ---------------------------------------------------------------- seed: int64 for every sample

@pytest.mark.parametrize("seed,n", [(I64_MAX + 1, 1), (I64_MAX, 2), (I64_MAX - 2, 4), (I64_MIN - 1, 1), (2**100, 1)])
def test_seed_outside_int64_for_n_samples_names_seed_range_and_value(seed, n):
    with pytest.raises(GraphDSLError, match=rf"invalid SamplingParams: {SEED_RANGE}.*got {seed} with n={n}"):
        SamplingParams(seed=seed, n=n)


@pytest.mark.parametrize("seed,n", [(I64_MAX, 1), (I64_MAX - 1, 2), (I64_MIN, 1), (I64_MIN, 5), (0, 1), (None, 8)])
def test_seed_at_the_int64_edges_is_taken(seed, n):
    sp = SamplingParams(seed=seed, n=n)
    assert (sp.seed, sp.n) == (seed, n)


def _run_samples(sp: SamplingParams, seed: int, n: int) -> list:
    """``n`` samples of one prompt through a real serving loop and sampler, seeded as
    ``LLM.generate`` seeds them (sample ``i`` with ``seed + i``)."""
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    loop = ServingLoop(FakeModel(blocks, 32), sched)
    reqs = []
    for i in range(n):
        reqs.append(sched.add_request(("r", i), [1, 2, 3], sp, parent=reqs[0] if i else None, seed=seed + i))
    while loop.has_work():
        loop.step()
    return reqs


def test_the_range_taken_is_the_one_the_sampler_runs():
    """The top and bottom of the range sample; one past the top is what crashed in the sampler."""
    for seed in (I64_MAX - 1, I64_MIN):
        sp = SamplingParams(max_tokens=3, temperature=0.8, seed=seed, n=2)
        reqs = _run_samples(sp, sp.seed, sp.n)
        assert all(r.status is RequestStatus.FINISHED and len(r.output_ids) == 3 for r in reqs)
    with pytest.raises(OverflowError):                     # the int64 packing of the sampler's inputs
        _run_samples(SamplingParams(max_tokens=3, temperature=0.8), I64_MAX, 2)


def test_seed_is_checked_when_seed_or_n_is_assigned():
    sp = SamplingParams(seed=I64_MAX - 1, n=2)
    with pytest.raises(GraphDSLError, match=rf"{SEED_RANGE}.*got {I64_MAX - 1} with n=3"):
        sp.n = 3
    with pytest.raises(GraphDSLError, match=rf"{SEED_RANGE}.*got {I64_MAX} with n=2"):
        sp.seed = I64_MAX
    assert (sp.seed, sp.n) == (I64_MAX - 1, 2)
    sp.seed = None
    sp.n = 64
    assert (sp.seed, sp.n) == (None, 64)


# ---------------------------------------------------------------- stop: one string, as vLLM takes it

def test_a_single_stop_string_is_a_one_element_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    sp = SamplingParams()
    sp.stop = "END"
    assert sp.stop == ["END"]


@pytest.mark.parametrize("stop", ["", [""], ("a", "")])
def test_empty_stop_strings_stay_refused(stop):
    with pytest.raises(GraphDSLError, match=rf"stop must be a list of non-empty strings.*got {re.escape(repr(stop))}"):
        SamplingParams(stop=stop)


# ---------------------------------------------------------------- every check runs on assignment

@pytest.mark.parametrize("field,value,message", [
    ("stop", [""], r"stop must be a list of non-empty strings.*got \[''\]"),
    ("stop", "", r"stop must be a list of non-empty strings.*got ''"),
    ("min_tokens", 50, r"min_tokens must be an integer >= 0 and <= max_tokens=5, got 50"),
    ("max_tokens", 1, r"min_tokens must be an integer >= 0 and <= max_tokens=1, got 2"),
    ("stop_token_ids", [-1], r"stop_token_ids must be a list of integers >= 0, got \[-1\]"),
    ("stop_token_ids", [2, True], r"stop_token_ids\[1\] must be a list of integers >= 0, got True"),
    ("temperature", float("inf"), r"temperature must be a float >= 0 \(0 = greedy\), got inf"),
    ("n", True, r"n must be an integer >= 1 \(parallel samples of one prompt\), got True"),
    ("ignore_eos", "false", r"ignore_eos must be a bool, got 'false'"),
])
def test_a_refused_assignment_names_the_problem_and_changes_nothing(field, value, message):
    sp = SamplingParams(max_tokens=5, min_tokens=2, stop=["x"], stop_token_ids=[7], seed=11)
    before, fields_set = sp.model_dump(), set(sp.model_fields_set)
    with pytest.raises(GraphDSLError, match=rf"invalid SamplingParams: {message}"):
        setattr(sp, field, value)
    assert sp.model_dump() == before and sp.model_fields_set == fields_set


def test_an_unknown_field_is_refused_on_assignment_too():
    sp = SamplingParams()
    with pytest.raises(GraphDSLError, match=r"unknown field 'topp'; allowed fields: \[.*'top_p'"):
        sp.topp = 0.5


def test_valid_assignments_still_go_through():
    sp = SamplingParams(max_tokens=5)
    sp.max_tokens, sp.min_tokens, sp.stop_token_ids, sp.temperature = 50, 50, (0, 9), 0
    assert (sp.max_tokens, sp.min_tokens, sp.stop_token_ids, sp.greedy) == (50, 50, [0, 9], True)
    assert isinstance(sp.temperature, float)


# ---------------------------------------------------------------- strict types, finite floats

@pytest.mark.parametrize("field,value,allowed", [
    ("n", True, r"an integer >= 1 \(parallel samples"),
    ("n", 2.0, r"an integer >= 1 \(parallel samples"),
    ("max_tokens", "10", "an integer >= 1"),
    ("max_tokens", 10.0, "an integer >= 1"),
    ("min_tokens", False, "an integer >= 0 and <= max_tokens"),
    ("top_k", True, r"an integer >= -1"),
    ("logprobs", True, r"None or an integer in \[0, 20\]"),
    ("prompt_logprobs", "3", r"None or an integer in \[0, 20\]"),
    ("seed", True, "an integer or None"),
    ("seed", 3.0, "an integer or None"),
    ("ignore_eos", "yes", "a bool"),
    ("ignore_eos", "false", "a bool"),
    ("ignore_eos", 0, "a bool"),
    ("ignore_eos", 1, "a bool"),
    ("temperature", "0.5", r"a float >= 0 \(0 = greedy\)"),
    ("temperature", True, r"a float >= 0 \(0 = greedy\)"),
    ("top_p", False, r"a float in \(0, 1\]"),
    ("presence_penalty", "1", r"a float in \[-2, 2\]"),
    ("stop", 5, "a list of non-empty strings"),
    ("stop", {"a"}, "a list of non-empty strings"),
    ("stop_token_ids", "12", "a list of integers >= 0"),
    ("stop_token_ids", 12, "a list of integers >= 0"),
])
def test_values_of_the_wrong_type_are_not_coerced(field, value, allowed):
    message = rf"invalid SamplingParams: {field} must be {allowed}.*got {re.escape(repr(value))}"
    with pytest.raises(GraphDSLError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value,allowed", [
    ("stop", ["a", b"b"], r"stop\[1\] must be a list of non-empty strings"),
    ("stop_token_ids", [1, True], r"stop_token_ids\[1\] must be a list of integers >= 0"),
    ("stop_token_ids", (1, 2.0), r"stop_token_ids\[1\] must be a list of integers >= 0"),
    ("stop_token_ids", [1, "2"], r"stop_token_ids\[1\] must be a list of integers >= 0"),
])
def test_list_entries_of_the_wrong_type_name_their_index(field, value, allowed):
    with pytest.raises(GraphDSLError, match=rf"{allowed}.*, got {re.escape(repr(value[1]))}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_floats_are_refused(field, value):
    with pytest.raises(GraphDSLError, match=rf"{field} must be a float.*got {value!r} \(floats must be finite\)"):
        SamplingParams(**{field: value})


def test_ints_are_taken_for_floats_and_stored_as_floats():
    sp = SamplingParams(temperature=0, top_p=1, min_p=0, repetition_penalty=2, presence_penalty=-2,
                        frequency_penalty=1)
    values = [sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty]
    assert values == [0.0, 1.0, 0.0, 2.0, -2.0, 1.0] and all(type(v) is float for v in values)
    assert sp.greedy and sp.uses_penalties


def test_model_validate_is_strict_too():
    assert SamplingParams.model_validate({"stop": "\n", "seed": I64_MIN}).stop == ["\n"]
    with pytest.raises(GraphDSLError, match=r"max_tokens must be an integer >= 1, or None \(as many as max_model_len leaves room for\), got '10'"):
        SamplingParams.model_validate({"max_tokens": "10"})


def test_model_validate_json_refuses_with_the_constructors_errors():
    from graphdsl.errors import GraphDSLError
    from graphdsl.runtime.serving.sampling import SamplingParams
    assert SamplingParams.model_validate_json('{"temperature": 0, "stop": "x"}').stop == ["x"]
    with pytest.raises(GraphDSLError, match=r"invalid SamplingParams: temperature must be a float >= 0"):
        SamplingParams.model_validate_json('{"temperature": "hot"}')
    with pytest.raises(GraphDSLError, match=r"model_validate_json expects a JSON object's text"):
        SamplingParams.model_validate_json("{not json")
    with pytest.raises(GraphDSLError, match=r"model_validate expects a dict, got \[1\]"):
        SamplingParams.model_validate_json("[1]")


def test_none_stop_and_stop_token_ids_are_vllms_empty_default():
    """vLLM's SamplingParams defaults both to None; a caller passing None explicitly (forwarding an
    OpenAI request's null) gets no stop strings / ids, on construction and on assignment."""
    sp = SamplingParams(stop=None, stop_token_ids=None)
    assert sp.stop == [] and sp.stop_token_ids == []
    sp.stop, sp.stop_token_ids = ["x"], [3]
    sp.stop = None
    sp.stop_token_ids = None
    assert sp.stop == [] and sp.stop_token_ids == []
    assert SamplingParams.model_validate_json('{"stop": null, "stop_token_ids": null}').stop == []


@pytest.mark.parametrize("temperature,greedy", [(0, True), (1e-60, True), (9.9e-6, True), (1e-5, False), (0.5, False)])
def test_a_temperature_below_vllms_epsilon_is_greedy(temperature, greedy):
    from graphdsl.runtime.serving.sampling import GREEDY_BELOW
    assert GREEDY_BELOW == 1e-5
    assert SamplingParams(temperature=temperature).greedy is greedy
