"""runtime/serving/sampler.py (the torch path) against independent formulations: HF logits
processors for top-k / top-p / min-p and the repetition penalty, a loop for the OpenAI penalties,
draw frequencies against the kept distribution, batch invariance and seeded replay."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.serving.sampler import (TOPK_SORT_LIMIT, PenaltyState, SamplingTensors, _threshold,
                                              compute_logprobs, sample_reference)

V = 200


def _st(rows, **common):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, seed=0, slot=-1)
    return SamplingTensors.build([{**base, **common, **r} for r in rows], "cpu")


def _kept(x, st):
    return x >= _threshold(x, st)[:, None]


@pytest.mark.parametrize("kw,warper", [
    (dict(top_k=7), TopKLogitsWarper(7)),
    (dict(top_p=0.6), TopPLogitsWarper(0.6)),
    (dict(top_p=0.93), TopPLogitsWarper(0.93)),
    (dict(min_p=0.05), MinPLogitsWarper(0.05)),
])
def test_truncation_keeps_what_hf_keeps(kw, warper):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g) * 2
    ref = torch.isfinite(warper(None, x.clone()))
    assert torch.equal(_kept(x, _st([{}] * 6, **kw)), ref)


def test_top_k_then_top_p_matches_hf_order():
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 3
    ref = torch.isfinite(TopPLogitsWarper(0.8)(None, TopKLogitsWarper(20)(None, x.clone())))
    assert torch.equal(_kept(x, _st([{}] * 4, top_k=20, top_p=0.8)), ref)


def test_top_p_with_top_k_uses_no_full_sort_and_equals_the_full_sort():
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 2
    st = _st([{}] * 3, top_k=30, top_p=0.7)
    assert not st.full_sort
    full = _st([{}] * 3, top_k=30, top_p=0.7)
    full.full_sort = True
    assert torch.equal(_threshold(x, st), _threshold(x, full))


def test_ties_are_kept_or_cut_together():
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    assert _kept(x, _st([{}], top_k=2)).tolist() == [[True, True, True, True, False, False]]
    p3 = math.exp(3) / (math.exp(3) + 3 * math.exp(2) + math.exp(1) + 1)
    # the mass strictly above the tied 2.0s is p(3.0) < top_p: all three 2.0s stay
    assert _kept(x, _st([{}], top_p=p3 + 1e-3)).tolist() == [[True, True, True, True, False, False]]
    assert _kept(x, _st([{}], top_p=p3 - 1e-3)).tolist() == [[True, False, False, False, False, False]]


def test_penalties_match_hf_and_a_loop():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=g) * 2
    pen = PenaltyState(4, V, "cpu")
    prompts, outs = [[1, 2, 3, 3], [10, 11]], [[5, 5, 7], [11, 12, 12, 12]]
    for slot, (p, o) in enumerate(zip(prompts, outs), start=1):
        pen.reset(slot, p, o)
    st = _st([dict(slot=1, repetition_penalty=1.7, temperature=0), dict(slot=2, presence_penalty=0.7,
                                                                        frequency_penalty=0.4, temperature=0)])
    from graphdsl.runtime.serving.sampler import _penalized
    got = _penalized(logits.clone(), st, pen)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompts[0] + outs[0]]), logits[:1].clone())
    assert torch.allclose(got[0], hf[0])
    ref = logits[1].clone()
    for t in set(outs[1]):
        ref[t] -= 0.4 * outs[1].count(t) + 0.7
    assert torch.allclose(got[1], ref)
    tokens = sample_reference(logits.clone(), st, torch.zeros(2, dtype=torch.int64), penalties=pen)
    assert tokens.tolist() == got.argmax(dim=1).tolist()


def test_penalty_state_record_and_reset():
    pen = PenaltyState(3, 20, "cpu")
    pen.reset(0, [1, 2], [4])
    pen.record(torch.tensor([0, -1, 2]), torch.tensor([4, 9, 7]))
    assert pen.counts[0, 4] == 2 and pen.counts[2, 7] == 1 and int(pen.counts.sum()) == 3
    assert pen.prompt_mask[0].nonzero().flatten().tolist() == [1, 2]
    pen.reset(0, [3], [])
    assert int(pen.counts[0].sum()) == 0 and pen.prompt_mask[0].nonzero().flatten().tolist() == [3]


def test_banned_ids_are_never_drawn_and_greedy_skips_them():
    logits = torch.zeros(2, V)
    logits[:, 5] = 10.0
    banned = torch.tensor([[5, -1], [-1, -1]])
    st = _st([dict(temperature=0), dict(temperature=0)])
    assert sample_reference(logits.clone(), st, torch.zeros(2, dtype=torch.int64), banned=banned).tolist()[1] == 5
    assert sample_reference(logits.clone(), st, torch.zeros(2, dtype=torch.int64), banned=banned).tolist()[0] != 5


def test_draws_follow_the_kept_distribution():
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    st = _st([{}], top_k=4, seed=123)
    p = torch.softmax(x[0, :4], dim=0)
    n = 20000
    counts = torch.zeros(6)
    logits = x.expand(n, 6).contiguous()
    st_n = _st([{}] * n, top_k=4, seed=123)
    draws = sample_reference(logits.clone(), st_n, torch.arange(n, dtype=torch.int64))
    counts += torch.bincount(draws, minlength=6)
    assert counts[4:].sum() == 0
    chi2 = float((((counts[:4] - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 16.3, chi2                                 # 3 degrees of freedom, p = 0.001
    assert st.max_top_k == 4


def test_rows_are_batch_invariant_and_replay_with_their_seed():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, V, generator=g) * 2
    rows = [dict(seed=11, top_p=0.9), dict(seed=12, top_k=5), dict(temperature=0), dict(seed=13, min_p=0.1),
            dict(seed=14, temperature=0.5)]
    ctr = torch.tensor([3, 9, 1, 4, 7])
    together = sample_reference(logits.clone(), _st(rows), ctr)
    for r in range(5):
        alone = sample_reference(logits[r:r + 1].clone(), _st([rows[r]]), ctr[r:r + 1])
        assert alone.item() == together[r].item()
    again = sample_reference(logits.clone(), _st(rows), ctr)
    assert torch.equal(again, together)
    moved = sample_reference(logits.clone(), _st(rows), ctr + 1)
    assert not torch.equal(moved, together)


def test_compute_logprobs_matches_log_softmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    toks = torch.tensor([0, 17, 199])
    ids, lps, tok_lp, rank = compute_logprobs(logits, toks, 4)
    ref = torch.log_softmax(logits, dim=1)
    assert torch.equal(ids, ref.topk(4).indices) and torch.allclose(lps, ref.topk(4).values)
    assert torch.allclose(tok_lp, ref.gather(1, toks[:, None]).squeeze(1))
    assert rank.tolist() == [1 + int((ref[i] > ref[i, t]).sum()) for i, t in enumerate(toks.tolist())]
    assert compute_logprobs(logits, toks, 0)[0].shape == (3, 0)


def test_errors_name_the_argument():
    st = _st([{}])
    with pytest.raises(GraphDSLError, match=r"logits must be a float32, bfloat16 or float16 \[R, vocab\].*int32"):
        sample_reference(torch.zeros(1, V, dtype=torch.int32), st, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(GraphDSLError, match=r"counters must be int64 \[1\]"):
        sample_reference(torch.zeros(1, V), st, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(GraphDSLError, match="SamplingTensors hold 1 rows, logits 2"):
        sample_reference(torch.zeros(2, V), st, torch.zeros(2, dtype=torch.int64))


def test_build_reads_rows_into_columns_and_summaries_as_written():
    """``SamplingTensors.build`` reads the rows in C (``itemgetter``) and derives its summaries from
    the columns; random batches (greedy, sampled, mixed, empty) against each summary's definition."""
    import random
    rng = random.Random(0)
    for trial in range(200):
        rows = [dict(temperature=rng.choice([0.0, 0.0, 0.7, 1.3]), top_k=rng.choice([0, 0, 5, 2000]),
                     top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                     presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=0.25, repetition_penalty=1.1,
                     seed=rng.randrange(2 ** 40), slot=rng.choice([-1, -1, 3]))
                for _ in range(rng.randrange(0, 6))]
        st = SamplingTensors.build(rows, "cpu")
        sampled = [r for r in rows if r["temperature"] > 0]
        assert st.all_greedy == (not sampled) and st.any_greedy == (len(sampled) < len(rows))
        assert st.any_penalty == any(r["slot"] >= 0 for r in rows)
        assert st.max_top_k == max((r["top_k"] for r in sampled if r["top_k"] > 0), default=0)
        assert st.any_top_p == any(r["top_p"] < 1.0 for r in sampled)
        assert st.any_min_p == any(r["min_p"] > 0 for r in sampled)
        assert st.full_sort == any(r["top_p"] < 1.0 and not 0 < r["top_k"] <= TOPK_SORT_LIMIT for r in sampled)
        assert st.all_top_k == (bool(sampled) and all(r["top_k"] > 0 for r in sampled))
        for k in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            assert getattr(st, k).dtype == torch.float32
            assert getattr(st, k).tolist() == pytest.approx([r[k] for r in rows]), (trial, k)
        for k in ("top_k", "seed", "slot"):
            assert getattr(st, k).dtype == torch.int64 and getattr(st, k).tolist() == [r[k] for r in rows], (trial, k)
