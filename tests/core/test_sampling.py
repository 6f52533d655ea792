"""runtime/serving/sampling.py against independent formulations (HF processors, loops, draw statistics)."""
from __future__ import annotations

import math

import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.serving.sampling import (SamplingParams, apply_repetition_penalty, make_generator,
                                       sample, sampling_probs)


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
])
def test_out_of_range_names_field_range_and_value(field, value, allowed):
    with pytest.raises(GraphDSLError, match=rf"{field} must be {allowed}.*got {value!r}"):
        SamplingParams(**{field: value})


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


# ---------------------------------------------------------------- repetition penalty vs HF

def test_repetition_penalty_matches_transformers():
    tr = pytest.importorskip("transformers")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    prev = [[1, 4, 4, 9, 49], [0, 2], [7, 8, 10, 11]]
    ours = apply_repetition_penalty(logits.clone(), [1.3, 1.3, 1.3], prev)
    for i in range(3):
        proc = RepetitionPenaltyLogitsProcessor(penalty=1.3)
        ref = proc(torch.tensor([prev[i]]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i], ref[0])


def test_repetition_penalty_off_and_bad_ids():
    logits = torch.randn(2, 10)
    out = apply_repetition_penalty(logits.clone(), [1.0, 2.0], [[1, 2], []])
    torch.testing.assert_close(out, logits)
    with pytest.raises(GraphDSLError, match=r"prev_tokens\[0\] holds ids outside \[0, 10\): \[10\]"):
        apply_repetition_penalty(logits.clone(), [1.5], [[3, 10]])


# ---------------------------------------------------------------- filtering vs a loop formulation

def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Independent: plain Python over a sorted list of (prob, token)."""
    x = [float(v) / p.temperature for v in logits.tolist()]
    keep = set(range(len(x)))
    if p.top_k > 0:
        kth = sorted(x, reverse=True)[min(p.top_k, len(x)) - 1]
        keep = {t for t in keep if x[t] >= kth}
    if p.top_p < 1.0:
        m = max(x[t] for t in keep)
        z = sum(math.exp(x[t] - m) for t in keep)
        ranked = sorted(keep, key=lambda t: -x[t])
        kept, mass = set(), 0.0
        for t in ranked:
            kept.add(t)
            mass += math.exp(x[t] - m) / z
            if mass >= p.top_p:
                break
        keep = kept
    m = max(x[t] for t in keep)
    z = sum(math.exp(x[t] - m) for t in keep)
    return torch.tensor([math.exp(x[t] - m) / z if t in keep else 0.0 for t in range(len(x))])


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=10, top_p=0.6),
    dict(temperature=1.0, top_p=0.01),          # at least one token always kept
    dict(temperature=1.0, top_k=-1, top_p=1.0),
    dict(temperature=2.0, top_k=1000),           # k larger than vocab
])
def test_probs_match_reference(kw):
    torch.manual_seed(1)
    logits = torch.randn(4, 40) * 3
    p = SamplingParams(**kw)
    got = sampling_probs(logits, [p] * 4, [[]] * 4)
    for i in range(4):
        torch.testing.assert_close(got[i], _reference_probs(logits[i], p), atol=1e-5, rtol=1e-4)


def test_top_k_keeps_ties():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    probs = sampling_probs(logits, [SamplingParams(top_k=2)], [[]])
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]


def test_top_k_then_top_p_with_ties_matches_reference():
    """Ties at the k-th value survive top-k; top-p cut points chosen outside tie groups (which
    of several tied tokens a prefix keeps is an arbitrary order)."""
    cases = [([3.0, 2.0, 2.0, 1.0, 0.0, 2.0], dict(top_k=2, top_p=0.9)),    # 3 and all three 2s
             ([3.0, 2.0, 2.0, 1.0, 0.0, 2.0], dict(top_k=2, top_p=0.4)),    # only the 3
             ([0.5, 0.5, 0.5, 0.5, 0.1, 0.0], dict(top_k=3, top_p=0.95))]   # all four 0.5s
    for row, kw in cases:
        p = SamplingParams(**kw)
        logits = torch.tensor([row])
        got = sampling_probs(logits, [p], [[]])[0]
        torch.testing.assert_close(got, _reference_probs(logits[0], p), atol=1e-6, rtol=1e-5)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs 0.5, 0.25, 0.25 (exact in binary): p=0.75 is reached by the first two -> third dropped
    logits = torch.tensor([[0.5, 0.25, 0.125]]).log()
    logits[0, 2] = math.log(0.25) - 1e-4   # distinct order, mass still ~0.25
    probs = sampling_probs(logits, [SamplingParams(top_p=0.74)], [[]])
    assert (probs[0] > 0).tolist() == [True, True, False]
    probs = sampling_probs(logits, [SamplingParams(top_p=0.76)], [[]])
    assert (probs[0] > 0).tolist() == [True, True, True]


def test_mixed_batch_rows_are_independent():
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    ps = [SamplingParams(top_k=3), SamplingParams(top_p=0.5, temperature=0.5), SamplingParams()]
    got = sampling_probs(logits, ps, [[]] * 3)
    for i in range(3):
        torch.testing.assert_close(got[i], _reference_probs(logits[i], ps[i]), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- sample()

def test_greedy_is_argmax_after_penalty():
    logits = torch.tensor([[1.0, 5.0, 4.0, -1.0], [0.0, 0.1, 0.2, 0.3]])
    ps = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    out = sample(logits, ps, [None, None], [[1], []])
    assert out.dtype == torch.int64
    assert out.tolist() == [2, 3]  # token 1: 5 / 2 = 2.5 < 4


def test_seeded_rows_reproduce_regardless_of_batch():
    torch.manual_seed(3)
    logits = torch.randn(3, 100)
    p = SamplingParams(seed=1234, temperature=1.0)
    draws = []
    for _ in range(2):
        gens = [make_generator(p), None, make_generator(SamplingParams(seed=7))]
        seq = [sample(logits, [p, SamplingParams(), SamplingParams(seed=7)], gens, [[]] * 3)[0].item()
               for _ in range(10)]
        draws.append(seq)
    alone = []
    g = make_generator(p)
    for _ in range(10):
        alone.append(sample(logits[:1], [p], [g], [[]])[0].item())
    assert draws[0] == draws[1] == alone
    assert make_generator(SamplingParams()) is None


def test_draw_frequencies_match_distribution():
    torch.manual_seed(4)
    logits = torch.randn(1, 8) * 1.5
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=0)
    expected = _reference_probs(logits[0], p)
    g = make_generator(p)
    n = 4000
    counts = torch.zeros(8)
    batch = logits.expand(n, 8).contiguous()
    out = sample(batch, [p] * n, [g] * n, [[]] * n)
    counts += torch.bincount(out, minlength=8).float()
    # tokens outside the kept set never appear; kept ones within 5 binomial sigmas
    assert torch.all(counts[expected == 0] == 0)
    sigma = (n * expected * (1 - expected)).sqrt()
    assert torch.all((counts - n * expected).abs() <= 5 * sigma + 1), (counts, n * expected)
    # and the chi-square statistic is plausible for the kept tokens (dof <= 5; p=1e-4 bound 25.7)
    kept = expected > 0
    chi2 = (((counts - n * expected) ** 2) / (n * expected))[kept].sum()
    assert chi2 < 25.7


def test_unseeded_rows_follow_distribution_and_greedy_rows_stay_argmax():
    torch.manual_seed(5)
    logits = torch.randn(1, 6) * 2
    p = SamplingParams(temperature=1.0)
    n = 3000
    rows = logits.expand(n, 6).contiguous()
    params = [p] * n
    params[0] = SamplingParams(temperature=0)
    out = sample(rows, params, [None] * n, [[]] * n)
    assert out[0].item() == logits.argmax().item()
    expected = torch.softmax(logits[0], -1)
    counts = torch.bincount(out[1:], minlength=6).float()
    sigma = ((n - 1) * expected * (1 - expected)).sqrt()
    assert torch.all((counts - (n - 1) * expected).abs() <= 5 * sigma + 1)


def test_sample_shape_errors():
    with pytest.raises(GraphDSLError, match=r"logits must be a 2-D tensor \[n, vocab\], got \(5,\)"):
        sample(torch.zeros(5), [SamplingParams()], [None], [[]])
    with pytest.raises(GraphDSLError, match=r"one entry per logits row \(2\), got lengths \{'generators': 1\}"):
        sample(torch.zeros(2, 5), [SamplingParams()] * 2, [None], [[], []])
    with pytest.raises(GraphDSLError, match=r"params\[0\] must be a SamplingParams, got dict"):
        sample(torch.zeros(1, 5), [{"temperature": 0}], [None], [[]])
