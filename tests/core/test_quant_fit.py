"""graphdsl.quant_fit: the weighted least-squares step search of the online quantizers against plain
round-to-nearest, exact on values already on a grid, the same in CPU chunks as in one pass, and the
int4 schemes' smaller error."""
import pytest
import torch

import graphdsl.quant as Q
import graphdsl.quant_fit as QF
from graphdsl.quant import parse_scheme


def _weights(seed: int, rows: int = 64, k: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(rows, k, generator=g), torch.randn(rows, k, generator=g) ** 3])


def _affine_error(xs, s, low, levels):
    q = torch.round((xs + low[..., None]) / s[..., None]).clamp(0, levels)
    return (s[..., None] * q - low[..., None] - xs).square().sum()


def test_fit_affine_beats_the_span_over_the_levels():
    xs = _weights(0).reshape(-1, 8, 32)
    s, low = QF.fit_affine(xs, 15)
    assert (s >= 0).all() and (low >= 0).all()
    plain_low = (-xs.amin(-1)).clamp(min=0)
    plain = _affine_error(xs, (xs.amax(-1) + plain_low) / 15, plain_low, 15)
    assert _affine_error(xs, s, low, 15) < 0.9 * plain


def test_fit_symmetric_beats_max_over_qmax_and_keeps_the_sign_asked():
    xs = _weights(1).reshape(-1, 32)

    def error(s, qmin, qmax):
        return (s[:, None] * torch.round(xs / s[:, None]).clamp(qmin, qmax) - xs).square().sum()
    for qmin, qmax in ((-8, 7), (-32, 31), (-127, 127)):
        plain = error(xs.abs().amax(-1) / qmax, qmin, qmax)
        signed, positive = QF.fit_symmetric(xs, qmin, qmax), QF.fit_symmetric(xs, qmin, qmax, positive=True)
        assert (positive > 0).all() and (signed < 0).any()
        assert error(signed, qmin, qmax) < 0.97 * plain and error(positive, qmin, qmax) < 0.97 * plain


def test_values_on_a_grid_come_back_exactly():
    g = torch.Generator().manual_seed(2)
    step, low = torch.rand(40, 1, generator=g) + 0.5, torch.rand(40, 1, generator=g)
    codes = torch.randint(0, 16, (40, 32), generator=g).float()
    codes[:, 0], codes[:, 1] = 0, 15                                   # the group spans every level
    s, m = QF.fit_affine(step * codes - low, 15)
    torch.testing.assert_close(s, step[:, 0], rtol=1e-4, atol=0)
    torch.testing.assert_close(m, low[:, 0], rtol=1e-4, atol=1e-5)
    s = QF.fit_symmetric(step * (codes - 8), -8, 7, positive=True)
    torch.testing.assert_close(s, step[:, 0], rtol=1e-4, atol=0)
    s, z = QF.fit_zero_point(step * (codes - 4), 15)
    torch.testing.assert_close(s, step[:, 0], rtol=1e-4, atol=0)
    torch.testing.assert_close(z, torch.full((40,), 4.0))


def test_all_zero_groups_give_zero_steps_not_nan():
    xs = torch.zeros(3, 32)
    for out in (*QF.fit_affine(xs, 15), QF.fit_symmetric(xs, -8, 7), QF.fit_symmetric(xs, -8, 7, positive=True),
                *QF.fit_zero_point(xs, 15)):
        assert torch.equal(out, torch.zeros(3))


@pytest.mark.parametrize("fit,args", [(QF.fit_affine, (15,)), (QF.fit_affine, (31, True)),
                                      (QF.fit_zero_point, (15,)), (QF.fit_symmetric, (-32, 31))])
def test_cpu_chunks_give_what_one_pass_gives(fit, args, monkeypatch):
    xs = _weights(3).reshape(-1, 16, 16)
    whole = fit(xs, *args)
    monkeypatch.setattr(QF, "CPU_CHUNK_VALUES", 7 * 256)               # 128 groups of 256 in 19 chunks
    chunked = fit(xs, *args)
    pairs = zip(*((t,) if torch.is_tensor(t) else t for t in (whole, chunked)))
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("name", ["int4-g32", "int4-g128", "int4-g64-zp", "int4-g128-zp"])
def test_int4_schemes_re_round_with_less_error_than_plain_round_to_nearest(name, monkeypatch):
    """Against the plain steps (``max|w| / 7``; zero points: the span over 15), less squared error
    on N(0, 1) and heavy-tailed weights (at least 3%; zero points, whose plain step already fits the
    span, 1%)."""
    w = _weights(4, k=512)
    scheme = parse_scheme(name)

    def error():
        back = scheme.dequantize(scheme.quantize(w, torch.bfloat16), w.shape[0], w.shape[1], torch.float32)
        return (back - w).square().sum().item()
    searched = error()
    monkeypatch.setattr(Q, "fit_symmetric", lambda xs, qmin, qmax, positive: xs.abs().amax(-1) / qmax)

    def plain_zero_point(xs, levels):
        lo, hi = xs.amin(-1).clamp(max=0), xs.amax(-1).clamp(min=0)
        step = ((hi - lo) / levels).clamp(min=1e-12)
        return step, torch.round(-lo / step).clamp(0, levels)
    monkeypatch.setattr(Q, "fit_zero_point", plain_zero_point)
    assert searched < (0.99 if scheme.zero_point else 0.97) * error()
