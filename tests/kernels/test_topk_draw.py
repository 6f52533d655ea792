"""runtime/kernels/topk_draw.py: the two-launch draw of rows with a top-k gives the tokens of the
torch reference sampler (and of the torch.topk kernel path) — penalties, top-p, min-p, greedy rows,
ties at the k-th value past the counted extra (the full-row fallback), banned (-inf) entries,
16-bit logits — and writes the next inputs and the penalty counts like the other draws."""
import pytest
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.kernels.topk_draw import MAX_WIDTH, draw_top_k
from graphdsl.runtime.serving import sampler
from graphdsl.runtime.serving.sampler import PenaltyState, SamplingTensors, _sample, sample_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TIES = sampler.TIES_COUNTED


def _rows(n, **kw):
    base = dict(temperature=0.8, top_k=20, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, slot=-1)
    return [dict(base, seed=7 * i + 1, **kw) for i in range(n)]


def _draw(logits, st, ctr, pen=None, *, slice_tokens=None, ids=None, record=False):
    V = logits.shape[1]
    return draw_top_k(logits, st.temperature, st.slot, st.repetition_penalty, st.presence_penalty,
                      st.frequency_penalty, pen.counts if pen else None, pen.prompt_mask if pen else None,
                      min(st.max_top_k + TIES, V), st.min_p, st.top_k, st.top_p, TIES, st.seed, ctr,
                      mixed=st.any_greedy, ids=ids, record=(st.slot, pen.counts) if record else None,
                      slice_tokens=slice_tokens)


def _torch_topk_path(logits, st, ctr, pen=None):
    """The kernel path with torch.topk (the two-launch draw switched off)."""
    old, sampler.TOPK_DRAW = sampler.TOPK_DRAW, False
    try:
        return _sample(logits.clone(), st, ctr, pen, None, True)
    finally:
        sampler.TOPK_DRAW = old


@pytest.mark.parametrize("V,slice_tokens", [(3000, 512), (3000, None), (1000, 128), (20000, 4096)])
def test_draw_equals_reference_sampler(V, slice_tokens):
    g = torch.Generator().manual_seed(V)
    R = 8
    logits = (torch.randn(R, V, generator=g) * 3).to(DEV)
    rows = _rows(R)
    rows[1].update(top_k=1)
    rows[2].update(top_k=50, top_p=0.7)
    rows[3].update(top_k=5, min_p=0.2)
    rows[4].update(temperature=0.0, top_k=0)                  # greedy row in a sampled batch
    rows[5].update(top_k=100, top_p=0.95, temperature=1.7)
    rows[6].update(top_k=3, top_p=0.3, min_p=0.01)
    st = SamplingTensors.build(rows, DEV)
    assert st.all_top_k and st.any_greedy
    ctr = torch.arange(R, dtype=torch.int64, device=DEV) * 5 + 3
    got = _draw(logits.clone(), st, ctr, slice_tokens=slice_tokens)
    ref = sample_reference(logits.clone(), st, ctr)
    assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(got.cpu(), _torch_topk_path(logits, st, ctr).cpu())


def test_penalties_and_16_bit_logits():
    g = torch.Generator().manual_seed(3)
    R, V = 4, 3000
    logits = (torch.randn(R, V, generator=g) * 3).to(DEV, torch.bfloat16)
    rows = _rows(R, top_k=40, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3)
    rows[3].update(repetition_penalty=1.4)
    for i, r in enumerate(rows):
        r["slot"] = i
    st = SamplingTensors.build(rows, DEV)
    ctr = torch.tensor([3, 4, 5, 6], dtype=torch.int64, device=DEV)
    top = logits.float().topk(3, dim=1).indices.cpu()
    pen = PenaltyState(R, V, DEV)
    for r in range(R):                              # penalise each row's top tokens, so the draw moves
        pen.reset(r, [int(top[r, 0])], [int(top[r, 1]), int(top[r, 1]), int(top[r, 2])])
    got = _draw(logits, st, ctr, pen, slice_tokens=1024)
    ref = sample_reference(logits.float(), st, ctr, penalties=pen)
    assert torch.equal(got.cpu(), ref.cpu())


def test_ties_past_the_counted_extra_take_the_full_row():
    """Row 0: 300 tokens tied at the top (more than W = k + 64), so thr equals the W-th largest
    and kept tokens lie outside the candidates (the full-row draw); row 1: the tie group sits at
    the k-th value; row 2: half the row banned (-inf)."""
    g = torch.Generator().manual_seed(5)
    R, V = 3, 4000
    logits = (torch.randn(R, V, generator=g)).to(DEV)
    perm = torch.randperm(V, generator=g)
    logits[0, perm[:300].to(DEV)] = 9.0
    logits[1, perm[:4].to(DEV)] = torch.tensor([12.0, 11.0, 10.5, 10.2], device=DEV)
    logits[1, perm[4:400].to(DEV)] = 8.0
    logits[2, perm[:2000].to(DEV)] = float("-inf")             # banned half
    st = SamplingTensors.build(_rows(R, top_k=10, top_p=0.99), DEV)
    for seed, slice_tokens in ((0, 512), (1, None)):
        ctr = torch.full((R,), seed, dtype=torch.int64, device=DEV)
        got = _draw(logits.clone(), st, ctr, slice_tokens=slice_tokens)
        ref = sample_reference(logits.clone(), st, ctr)
        assert torch.equal(got.cpu(), ref.cpu())
    # the full row was drawn from: tokens tied at 9.0 past the W lowest ids come up
    n = 24
    st = SamplingTensors.build(_rows(n, top_k=10, top_p=0.99), DEV)
    got = _draw(logits[:1].repeat(n, 1), st, torch.arange(n, dtype=torch.int64, device=DEV), slice_tokens=512)
    tied = sorted(int(i) for i in perm[:300])
    assert set(got.tolist()) <= set(tied) and max(got.tolist()) > tied[10 + TIES - 1]


def test_greedy_rows_take_the_lowest_id_of_a_wide_tie():
    R, V = 2, 2048
    logits = torch.zeros(R, V, device=DEV)
    logits[0, 700:1500] = 5.0                      # 800 tied maxima: wider than W
    logits[1, 3] = -1.0
    rows = _rows(R, top_k=10)
    rows[0].update(temperature=0.0, top_k=0)
    st = SamplingTensors.build(rows, DEV)
    ctr = torch.zeros(R, dtype=torch.int64, device=DEV)
    got = _draw(logits, st, ctr, slice_tokens=256)
    assert int(got[0]) == 700
    assert torch.equal(got.cpu(), sample_reference(logits.clone(), st, ctr).cpu())


def test_writes_next_inputs_and_counts():
    g = torch.Generator().manual_seed(9)
    R, V = 3, 1500
    logits = (torch.randn(R, V, generator=g) * 2).to(DEV)
    rows = _rows(R, presence_penalty=0.1)
    rows[0]["slot"], rows[2]["slot"] = 1, 0
    st = SamplingTensors.build(rows, DEV)
    pen = PenaltyState(2, V, DEV)
    ctr = torch.arange(R, dtype=torch.int64, device=DEV)
    ids = torch.full((R,), -1, dtype=torch.int64, device=DEV)
    got = _draw(logits, st, ctr, pen, ids=ids, record=True)
    assert torch.equal(ids, got)
    assert int(pen.counts[1, int(got[0])]) == 1 and int(pen.counts[0, int(got[2])]) == 1
    assert int(pen.counts.sum()) == 2


def test_sampler_takes_it_only_when_every_sampled_row_has_a_top_k(monkeypatch):
    import graphdsl.runtime.kernels.topk_draw as TD
    calls = []
    real = TD.draw_top_k
    monkeypatch.setattr(TD, "draw_top_k", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = torch.randn(2, 600, generator=torch.Generator().manual_seed(1)).to(DEV)
    ctr = torch.zeros(2, dtype=torch.int64, device=DEV)
    for rows, used in ((_rows(2), True), (_rows(2, top_k=0), False), (_rows(2, top_k=MAX_WIDTH), False)):
        calls.clear()
        st = SamplingTensors.build(rows, DEV)
        got = _sample(logits.clone(), st, ctr, None, None, True)
        assert bool(calls) == used
        assert torch.equal(got.cpu(), sample_reference(logits.clone(), st, ctr).cpu())


def test_bad_arguments_are_named():
    st = SamplingTensors.build(_rows(1), DEV)
    ctr = torch.zeros(1, dtype=torch.int64, device=DEV)

    def call(logits, width, **kw):
        return draw_top_k(logits, st.temperature, st.slot, st.repetition_penalty, st.presence_penalty,
                          st.frequency_penalty, None, None, width, st.min_p, st.top_k, st.top_p, TIES, st.seed, ctr,
                          mixed=False, **kw)
    with pytest.raises(GraphDSLError, match=r"width must be in \[1, min\(V, 256\)\] = \[1, 100\], got 200"):
        call(torch.zeros(1, 100, device=DEV), 200)
    with pytest.raises(GraphDSLError, match=r"logits must be \[R, V\] with unit stride in V, got \(1, 100\) "
                                            r"strides \(200, 2\)"):
        call(torch.zeros(1, 200, device=DEV)[:, ::2], 84)
    with pytest.raises(GraphDSLError, match=r"40 slices of 256 candidates exceed 8192; raise slice_tokens \(got 256\)"):
        call(torch.zeros(1, 10000, device=DEV), 200, slice_tokens=256)
