"""runtime/kernels/sampling.py: the Triton Gumbel-max draw equals its torch reference (same
noise bits, same thresholds), for odd vocabulary sizes, extreme seeds and -inf entries; the full
sampler through the kernel equals the reference path."""
import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.kernels.sampling import gumbel_argmax, gumbel_argmax_reference
from graphdsl.runtime.serving.sampler import SamplingTensors, _sample, sample_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("V", [1, 1000, 1024, 3001, 20000])
def test_kernel_equals_reference(V):
    g = torch.Generator().manual_seed(V)
    R = 7
    x = (torch.randn(R, V, generator=g) * 3).to(DEV)
    x[0, : V // 2] = float("-inf")
    thr = torch.tensor([float("-inf"), 0.0, 1.0, -1.0, float("-inf"), 2.0, -0.5], device=DEV)
    thr = torch.minimum(thr, x.max(dim=1).values)                     # keep at least one token
    seed = torch.tensor([0, 1, 2**31, 2**32 + 7, 2**62 + 3, 99, 5], dtype=torch.int64, device=DEV)
    ctr = torch.tensor([0, 1, 2, 2**20, 77, 5, 2**31], dtype=torch.int64, device=DEV)
    got = gumbel_argmax(x, thr, seed, ctr)
    ref = gumbel_argmax_reference(x, thr, seed, ctr)
    assert torch.equal(got.cpu(), ref.cpu())
    assert bool((x.gather(1, got[:, None]).squeeze(1) >= thr).all())


def test_full_sampler_kernel_path_equals_reference():
    g = torch.Generator().manual_seed(0)
    R, V = 6, 2000
    logits = (torch.randn(R, V, generator=g) * 2).to(DEV)
    base = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, slot=-1)
    rows = [dict(base, seed=1), dict(base, seed=2, top_k=40), dict(base, seed=3, top_p=0.85),
            dict(base, seed=4, min_p=0.02), dict(base, temperature=0, seed=5), dict(base, seed=6, top_k=10, top_p=0.5)]
    st = SamplingTensors.build(rows, DEV)
    ctr = torch.arange(R, dtype=torch.int64, device=DEV) * 3
    got = _sample(logits.clone(), st, ctr, None, None, True)         # the Triton path, also on the CPU
    ref = sample_reference(logits.clone(), st, ctr)
    assert torch.equal(got.cpu(), ref.cpu())


@pytest.mark.parametrize("cuda", [True, False])
def test_sampler_reads_16_bit_logits_as_their_float32_cast(cuda):
    """A decode graph hands the sampler its logits in the model's dtype: every row draws what the
    float32 copy of the same logits draws (penalties, top-k, top-p, min-p, a greedy row, a ban)."""
    from graphdsl.runtime.serving.sampler import PenaltyState
    g = torch.Generator().manual_seed(8)
    R, V = 4, 3000
    logits = (torch.randn(R, V, generator=g) * 3).to(DEV, torch.bfloat16)
    rows = _rows(R, top_k=40, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3)
    rows[1]["temperature"] = 0.0
    rows[2]["min_p"] = 0.05
    for i, r in enumerate(rows):
        r["slot"] = i
    st = SamplingTensors.build(rows, DEV)
    ctr = torch.tensor([3, 4, 5, 6], dtype=torch.int64, device=DEV)
    banned = torch.tensor([[int(logits[0].float().argmax())], [-1], [-1], [-1]], dtype=torch.int64, device=DEV)
    got = {}
    for x in (logits, logits.float()):
        pen = PenaltyState(R, V, DEV)
        pen.reset(0, [1, 2], [int(logits[0].float().topk(2).indices[1])])
        got[x.dtype] = _sample(x.clone(), st, ctr, pen, banned, cuda, record=True).cpu()
    assert torch.equal(got[torch.bfloat16], got[torch.float32])
    with pytest.raises(GraphDSLError, match=r"float32, bfloat16 or float16 \[R, vocab\].*torch.int64"):
        _sample(logits.to(torch.int64), st, ctr, None, None, cuda)


def _rows(n, **kw):
    base = dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, slot=-1)
    return [dict(base, seed=i, **kw) for i in range(n)]


def test_penalize_kernel_equals_torch():
    from graphdsl.runtime.kernels.sampling import penalize
    from graphdsl.runtime.serving.sampler import PenaltyState, _penalized
    g = torch.Generator().manual_seed(1)
    R, V = 4, 3000
    logits = (torch.randn(R, V, generator=g) * 2).to(DEV)
    pen = PenaltyState(3, V, DEV)
    pen.reset(0, [1, 2, 3, 2999], [5, 5, 2999])
    pen.reset(2, [7], [8, 9, 9, 9])
    rows = _rows(R)
    rows[0].update(slot=0, repetition_penalty=1.3, presence_penalty=0.5)
    rows[1].update(temperature=0.0)
    rows[2].update(slot=2, frequency_penalty=-0.7, temperature=1.5)
    st = SamplingTensors.build(rows, DEV)
    got = penalize(logits, st.temperature, st.slot, st.repetition_penalty, st.presence_penalty,
                   st.frequency_penalty, pen.counts, pen.prompt_mask)
    ref = _penalized(logits.clone(), st, pen) / torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.8, top_k=40), dict(min_p=0.1, top_k=100),
                                dict(top_k=3, top_p=0.3, min_p=0.01)])
def test_threshold_kernel_equals_torch(kw):
    from graphdsl.runtime.kernels.sampling import threshold
    from graphdsl.runtime.serving.sampler import _prefix, _prefix_threshold
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 2000, generator=g) * 2).to(DEV)
    x[1, :100] = x[1, 0]                                   # a large tie group
    st = SamplingTensors.build(_rows(5, **kw), DEV)
    vals = _prefix(x, st)
    got = threshold(vals.contiguous(), st.min_p, st.top_k, st.top_p, 64)
    assert torch.equal(got.cpu(), _prefix_threshold(vals, st).cpu())


@pytest.mark.parametrize("R,V", [(1, 20000), (3, 1000), (5, 1)])
def test_argmax_and_advance(R, V):
    from graphdsl.runtime.kernels.sampling import argmax
    g = torch.Generator().manual_seed(R * V)
    x = torch.randn(R, V, generator=g).to(DEV)
    x[0, V // 3] = x[0, V // 2] = 50.0                                # a tie: the lower id wins
    assert argmax(x).cpu().tolist() == x.argmax(dim=1).cpu().tolist()
    ids = torch.full((R,), -5, dtype=torch.int64, device=DEV)
    pos = torch.arange(R, dtype=torch.int64, device=DEV) + 10
    lens = torch.tensor([7] * (R - 1) + [0], dtype=torch.int32, device=DEV)   # the last row is padding
    tok = argmax(x, advance=(ids, pos, lens))
    assert ids.tolist() == tok.tolist() == x.argmax(dim=1).tolist()
    assert pos.tolist() == [11 + i for i in range(R - 1)] + [9 + R] and lens.tolist() == [8] * (R - 1) + [0]


@pytest.mark.parametrize("blocks", [1, 8])
def test_one_launch_draw_leaves_its_arrival_counters_at_zero(monkeypatch, blocks):
    """The last slice of a row to arrive picks the row's token and resets the row's counter, so a
    later launch over the same counters (a replayed CUDA graph) draws right again: three launches
    in a row, slices of one block (5 a row) or of eight (one a row), a tie across slices."""
    from graphdsl.runtime.kernels import sampling
    monkeypatch.setattr(sampling, "_SLICE_BLOCKS", blocks)
    R, V = 3, 5000
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(R, V, generator=g).to(DEV)
        x[1, 10] = x[1, 4500] = 40.0                                  # a tie across slices: the lower id
        seed = torch.arange(R, dtype=torch.int64, device=DEV) + i
        ctr = torch.full((R,), i, dtype=torch.int64, device=DEV)
        thr = torch.full((R,), float("-inf"), device=DEV)
        assert sampling.argmax(x).tolist() == x.argmax(dim=1).tolist() and x.argmax(dim=1)[1] == 10
        assert torch.equal(sampling.gumbel_argmax(x, thr, seed, ctr).cpu(),
                           sampling.gumbel_argmax_reference(x, thr, seed, ctr).cpu())
    assert sampling._slices(R, V, 1024)[1] == (5 if blocks == 1 else 1)      # slices a row
    assert all(int(c.abs().sum()) == 0 for bufs in sampling._ARRIVALS.values() for c in bufs)
    assert sampling._arrivals(x.device, 7).data_ptr() == sampling._arrivals(x.device, R).data_ptr()   # one buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_argmax_of_16_bit_logits_is_the_argmax_of_their_float32_cast(dtype):
    """The decode graph takes the greedy token from the logits in the model's dtype: the same token
    as the float32 copy would give, ties (many in 16 bits) going to the lowest id."""
    from graphdsl.runtime.kernels.sampling import argmax
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 3000, generator=g) * 4).to(dtype).to(DEV)
    x[1, 100] = x[1, 2500] = x[1].max() + 1                          # a tie: the lower id wins
    x[2, :] = x[2, 7]                                                # a whole row of ties
    want = argmax(x.float())
    assert argmax(x).tolist() == want.tolist() == x.float().argmax(dim=1).tolist()
    assert want[1] == 100 and want[2] == 0
    with pytest.raises(GraphDSLError, match=r"float32, bfloat16 or float16 \[R, V\].*torch.int32"):
        argmax(x.to(torch.int32))


def test_noise_is_strictly_inside_zero_one():
    """u must never round to 1 (g = +inf would pick a token whatever its logit): over every 32-bit
    hash the top 23 bits + 0.5 stay below 2**23 in float32."""
    from graphdsl.runtime.kernels.sampling import bits_to_unit, hash_uniform
    ends = bits_to_unit(torch.tensor([0, 2**32 - 1], dtype=torch.int64))
    assert 0.0 < float(ends[0]) and float(ends[1]) < 1.0
    u = hash_uniform(torch.arange(64, dtype=torch.int64), torch.arange(64, dtype=torch.int64) * 7, 4096)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0


@pytest.mark.parametrize("V,num", [(1000, 5), (20000, 20), (20000, 0), (7, 7)])
def test_logprobs_kernel_matches_log_softmax(V, num):
    """runtime/kernels/logprobs.py (one launch) vs compute_logprobs_reference (log_softmax + topk)."""
    from graphdsl.runtime.kernels.logprobs import logprobs
    from graphdsl.runtime.serving.sampler import compute_logprobs_reference
    torch.manual_seed(V + num)
    R = 3
    logits = torch.randn(R, V, device=DEV) * 3
    logits[0, :5] = float("-inf")                             # banned-style entries
    tokens = torch.randint(5, V, (R,), device=DEV)
    tokens[1] = logits[1].argmax()                            # rank 1
    ids, top, tok, rank = logprobs(logits, tokens, num)
    r_ids, r_top, r_tok, r_rank = compute_logprobs_reference(logits, tokens, num)
    assert ids.shape == (R, num) and top.dtype == torch.float32 and rank.dtype == torch.int64
    finite = r_top > float("-inf")                            # torch.topk orders ties (the -inf) arbitrarily
    assert torch.equal(ids[finite], r_ids[finite]) and torch.equal(rank, r_rank) and rank[1].item() == 1
    assert ids[~finite].tolist() == sorted(ids[~finite].tolist())          # the kernel: lowest id first
    torch.testing.assert_close(top, r_top, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(tok, r_tok, atol=2e-5, rtol=1e-5)


def test_logprobs_kernel_ties_go_to_the_lowest_id():
    from graphdsl.runtime.kernels.logprobs import logprobs
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]], device=DEV)
    ids, top, _, rank = logprobs(logits, torch.tensor([3], device=DEV), 4)
    assert ids.tolist() == [[1, 3, 4, 2]] and rank.tolist() == [1]
    assert top[0, 0] == top[0, 1] == top[0, 2] > top[0, 3]


def test_draw_writes_next_inputs_and_counts_and_keeps_greedy_rows():
    """The draw writes the tokens into ``ids`` and counts them per penalty slot; rows at
    temperature 0 in a sampled batch take the plain argmax."""
    from graphdsl.runtime.kernels.sampling import argmax
    g = torch.Generator().manual_seed(3)
    R, V = 4, 3000
    x = (torch.randn(R, V, generator=g) * 2).to(DEV)
    thr = torch.full((R,), float("-inf"), device=DEV)
    seed = torch.arange(R, dtype=torch.int64, device=DEV) + 11
    ctr = torch.full((R,), 5, dtype=torch.int64, device=DEV)
    temp = torch.tensor([0.7, 0.0, 1.0, 0.0], device=DEV)
    slot = torch.tensor([2, -1, 0, 1], dtype=torch.int64, device=DEV)
    counts = torch.zeros(3, V, dtype=torch.int32, device=DEV)
    ids = torch.full((R,), -1, dtype=torch.int64, device=DEV)
    tok = gumbel_argmax(x, thr, seed, ctr, temperature=temp, ids=ids, record=(slot, counts))
    drawn = gumbel_argmax_reference(x, thr, seed, ctr)
    want = torch.where(temp > 0, drawn, x.argmax(dim=1))
    assert tok.tolist() == ids.tolist() == want.tolist()
    expect = torch.zeros_like(counts)
    for r, s in enumerate(slot.tolist()):
        if s >= 0:
            expect[s, want[r]] += 1
    assert torch.equal(counts, expect)
    tok2 = argmax(x, ids=ids, record=(slot, counts))             # greedy: the same launch does both
    assert tok2.tolist() == ids.tolist() == x.argmax(dim=1).tolist()
    for r, s in enumerate(slot.tolist()):
        if s >= 0:
            expect[s, tok2[r]] += 1
    assert torch.equal(counts, expect)
    with pytest.raises(Exception, match=r"record's counts must be a contiguous int32 \[slots, 3000\]"):
        argmax(x, record=(slot, counts.to(torch.int64)))
    with pytest.raises(Exception, match=r"ids must be a contiguous torch.int64 \[4\], got torch.int32 \[4\]"):
        argmax(x, ids=ids.to(torch.int32))
    with pytest.raises(Exception, match=r"record's slot must be a contiguous torch.int64 \[4\], got torch.int64 \[2\]"):
        gumbel_argmax(x, thr, seed, ctr, record=(slot[:2], counts))


def test_sampler_records_and_writes_inputs_like_the_reference():
    """``sample(record=True, into=...)`` on the kernel path: same tokens, counts and inputs as the
    torch path (penalties, top-k and top-p, a greedy row among sampled ones)."""
    from graphdsl.runtime.serving.sampler import PenaltyState
    g = torch.Generator().manual_seed(4)
    R, V = 3, 5000
    logits = (torch.randn(R, V, generator=g) * 2).to(DEV)
    rows = _rows(R, top_k=50, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5)
    for i, r in enumerate(rows):
        r["slot"] = i
    rows[1]["temperature"] = 0.0
    st = SamplingTensors.build(rows, DEV)
    ctr = torch.tensor([7, 8, 9], dtype=torch.int64, device=DEV)
    out = {}
    for cuda in (True, False):
        pen = PenaltyState(R, V, DEV)
        pen.reset(0, [1, 2], [3, 3])
        into = torch.zeros(R, dtype=torch.int64, device=DEV)
        tok = _sample(logits.clone(), st, ctr, pen, None, cuda, record=True, into=into)
        out[cuda] = (tok.cpu(), into.cpu(), pen.counts.cpu())
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
    assert out[True][0].tolist() == out[True][1].tolist()
    assert int(out[True][2].sum()) == 2 + R                       # the reset's two tokens, one per row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_all_greedy_batch_is_one_argmax_launch(dtype, monkeypatch):
    """Greedy rows without penalties need no penalty/temperature pass: the kernel path takes the
    argmax of the logits as given (one launch, not two), the tokens the reference draws, a ban
    respected and ``into`` (the next decode inputs) filled."""
    from graphdsl.runtime.kernels import sampling as K

    def no_pass(*a, **k):
        raise AssertionError("an all-greedy batch without penalties launched the penalty pass")
    g = torch.Generator().manual_seed(3)
    R, V = 5, 3001
    logits = (torch.randn(R, V, generator=g) * 3).to(DEV, dtype)
    st = SamplingTensors.build(_rows(R, temperature=0.0), DEV)
    ctr = torch.arange(R, dtype=torch.int64, device=DEV)
    top = int(logits[0].float().argmax())
    banned = torch.tensor([[top], [-1], [-1], [-1], [-1]], dtype=torch.int64, device=DEV)
    into = torch.full((R,), -1, dtype=torch.int64, device=DEV)
    ref = sample_reference(logits.float(), st, ctr, banned=banned)
    monkeypatch.setattr(K, "penalize", no_pass)
    got = _sample(logits.clone(), st, ctr, None, banned, True, into=into)
    assert torch.equal(got.cpu(), ref.cpu()) and torch.equal(into.cpu(), got.cpu())
    assert int(got[0]) != top
