"""Least-squares steps for round-to-nearest integer codes, the online quantizers' search.

A group of values ``x`` (the last dim of ``xs``) is stored as integer codes ``q`` and a step ``s``
(and for the types with a min, a low ``m``): ``x ≈ s·q - m``. Plain round-to-nearest takes ``s``
from the group's span (``(max - min) / levels``, or ``max|x| / qmax``). Clipping the extremes a
little can make the other values' error smaller: :func:`fit_affine`, :func:`fit_zero_point` (an
integer zero point) and :func:`fit_symmetric` try a few candidate steps around the plain one
(:data:`SHIFTS`), round the codes for each, fit ``s`` (and ``m``) to those codes by weighted least
squares, and keep the candidate with the least weighted squared error. The weights
(:func:`importance`, ``|x|`` plus the group's rms) make a large value's error count more. The plain
candidate is among them, so the result never has a larger weighted error than round-to-nearest's
codes with the best step for them. Each group is independent; on the
CPU the groups go in chunks that stay in cache (:data:`CPU_CHUNK_VALUES`).

Why weighted, scored on SmolLM2 on the CPU (``benchmarks/quant_perplexity.py``: the mean KL
divergence of each position's next-token distribution from the float model's, in nats; one text's
perplexity moves by a few percent either way): int4-g128 0.589 with round-to-nearest, 0.547
unweighted, 0.446 weighted; int4-g32 0.432, 0.347, 0.307; GGUF Q4_0 0.345, 0.298, 0.286; int4-g64
with zero points 0.397, 0.350, 0.351.

Used by the GGUF block encoders (``graphdsl.runtime.gguf_scheme``) and the int4 schemes
(:class:`graphdsl.quant.IntScheme`).
"""
from __future__ import annotations

import functools

import torch

__all__ = ["SHIFTS", "fit_affine", "fit_symmetric", "fit_zero_point", "importance", "safe_div"]


def safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` where ``b != 0``, else 0 (an all-zero group's step and codes stay finite)."""
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


# candidate shifts of how many steps a group's span holds, -2 to 1 by quarters (0: round-to-nearest on
# min..max). On N(0, 1) weights the error sqrt(sum (w' - w)^2 / sum w^2) against plain round-to-nearest:
# Q4_K 0.0718 / 0.0785, Q5_K 0.0358 / 0.0382, Q6_K 0.0170 / 0.0193. Unweighted, 21 shifts by tenths
# over -1..1 did no better than these 13 (Q6_K 0.0173 against 0.0169)
SHIFTS = [i / 4 for i in range(-8, 5)]
# values a pass of the search takes at once: on the CPU a MB of float32 stays in cache (4x faster
# than one pass over a 4096 x 4096 weight); on a GPU 256 MB, so its temporaries (a few copies) stay
# within a few GB (one pass for an 8B model's largest matrix, 14336 x 4096)
CPU_CHUNK_VALUES, DEVICE_CHUNK_VALUES = 1 << 18, 1 << 26


def _by_chunks(fit):
    """``fit(xs, ...)`` over chunks of ``xs``'s leading dim of about :data:`CPU_CHUNK_VALUES` values
    on the CPU (:data:`DEVICE_CHUNK_VALUES` elsewhere), concatenated."""
    @functools.wraps(fit)
    def run(xs, *args, **kwargs):
        chunk = CPU_CHUNK_VALUES if xs.device.type == "cpu" else DEVICE_CHUNK_VALUES
        rows = max(1, chunk // max(1, xs[0].numel())) if xs.shape[0] else 1
        if xs.shape[0] <= rows:
            return fit(xs, *args, **kwargs)
        parts = [fit(c, *args, **kwargs) for c in xs.split(rows)]
        return (tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts))
    return run


def importance(xs: torch.Tensor) -> torch.Tensor:
    """The weight of each value's squared error in the fits: ``|x| + rms(group)``. A large value's
    error counts more (it moves the layer's outputs more), no value's counts for nothing."""
    return xs.abs() + xs.square().mean(-1, keepdim=True).sqrt()


@_by_chunks
def fit_affine(xs: torch.Tensor, levels: int, any_low: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (the last dim) the ``(step s >= 0, low m >= 0)`` of ``x ≈ s·q - m``, ``q`` in
    ``0..levels``, with the least weighted squared error (:func:`importance`) among these
    candidates: for each shift ``c`` of :data:`SHIFTS`, the codes ``q = clamp(round((x - lo) ·
    (levels + c) / (hi - lo)), 0, levels)`` (``lo = min(min x, 0)``), then ``s, -m`` the weighted
    least-squares slope and intercept of ``x`` on them (``m`` clamped to 0 when the fit wants a
    positive intercept, ``s`` then refitted through 0). ``any_low`` (Q4_1 / Q5_1, whose float16 min
    takes either sign): ``lo = min x`` and ``m`` of either sign. ``c = 0`` is round-to-nearest on
    ``lo..hi`` refitted, so the pick never does worse than plain round-to-nearest by that measure
    (before a K type rounds the steps onto its super-block's scale)."""
    lo = xs.amin(-1, keepdim=True) if any_low else xs.amin(-1, keepdim=True).clamp(max=0)
    above, per_span = xs - lo, safe_div(torch.ones_like(lo), xs.amax(-1, keepdim=True) - lo)
    wt = importance(xs)
    sw, swx = wt.sum(-1), (wt * xs).sum(-1)
    best = None
    for c in SHIFTS:
        q = torch.round(above * (per_span * (levels + c))).clamp(0, levels)
        wq = wt * q
        swq, swqq, swqx = wq.sum(-1), (wq * q).sum(-1), (wq * xs).sum(-1)
        slope = safe_div(sw * swqx - swq * swx, sw * swqq - swq * swq)
        off = safe_div(swx - slope * swq, sw)
        if not any_low:
            through_zero = off > 0
            slope = torch.where(through_zero, safe_div(swqx, swqq), slope).clamp(min=0)
            off = torch.where(through_zero, torch.zeros_like(off), off)
        # sum wt (slope q + off - x)^2 less sum wt x^2 (the same for every candidate), from the sums
        err = slope * (slope * swqq - 2 * swqx + 2 * off * swq) + off * (sw * off - 2 * swx)
        best = _keep_best(best, err, slope, -off)
    return best[1], best[2]


@_by_chunks
def fit_zero_point(xs: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (the last dim) the ``(step s >= 0, zero z)`` of ``x ≈ s·(q - z)``, ``q`` and the
    integer ``z`` in ``0..levels`` (int4 zero points), with the least weighted squared error
    (:func:`importance`) among: for each shift ``c`` of :data:`SHIFTS` the step ``t = (hi - lo) /
    (levels + c)`` (``lo = min(min x, 0)``, ``hi = max(max x, 0)``), ``z = clamp(round(-lo / t))``,
    ``q = clamp(round(x / t + z))``, then ``s`` the weighted least-squares ``sum w·(q - z)·x / sum
    w·(q - z)²``. ``c = 0`` is plain round-to-nearest on the span."""
    lo, hi = xs.amin(-1, keepdim=True).clamp(max=0), xs.amax(-1, keepdim=True).clamp(min=0)
    per_span, wt = safe_div(torch.ones_like(lo), hi - lo), importance(xs)
    best = None
    for c in SHIFTS:
        inv = per_span * (levels + c)
        z = torch.round(-lo * inv).clamp(0, levels)
        codes = torch.round(xs * inv + z).clamp(0, levels) - z
        wc = wt * codes
        scc, scx = (wc * codes).sum(-1), (wc * xs).sum(-1)
        # sum wt (s (q - z) - x)^2 at the least-squares s, less sum wt x^2: -scx^2 / scc
        best = _keep_best(best, -safe_div(scx * scx, scc), safe_div(scx, scc).clamp(min=0), z[..., 0])
    return best[1], best[2]


@_by_chunks
def fit_symmetric(xs: torch.Tensor, qmin: int, qmax: int, positive: bool = False) -> torch.Tensor:
    """Per group (the last dim) the signed step ``s`` of ``x ≈ s·q``, ``q`` in ``qmin..qmax``, with the
    least weighted squared error (:func:`importance`) among: round-to-nearest on ``±max|x|`` (``q =
    round(x · qmax / max|x|)``), and for each shift ``c`` of :data:`SHIFTS` the value ``big`` of
    largest magnitude sent near ``qmin`` (``q = round(x · (qmin - c) / big)``: where ``qmin = -qmax -
    1`` the extra negative level is used; ``c = 0`` is llama.cpp's reference rule for Q4_0 / Q5_0);
    each candidate's ``s`` is the weighted least-squares ``sum w·q·x / sum w·q²`` of its codes.
    ``positive`` (a format whose scales are positive): instead ``q = round(x · (qmax + c) / max|x|)``
    and ``round(x · (-qmin + c) / max|x|)`` for each shift, ``s > 0`` (0 for an all-zero group)."""
    big = xs.gather(-1, xs.abs().argmax(-1, keepdim=True))
    candidates = [safe_div(torch.full_like(big, qmax), big.abs())]        # plain, first: it wins ties
    if positive:
        candidates += [safe_div(torch.full_like(big, top + c), big.abs()) for top in sorted({qmax, -qmin})
                       for c in SHIFTS if (top, c) != (qmax, 0)]
    else:
        candidates += [safe_div(torch.full_like(big, qmin - c), big) for c in SHIFTS]
    wt, best = importance(xs), None
    for inv in candidates:
        q = torch.round(xs * inv).clamp(qmin, qmax)
        wq = wt * q
        sqq, sqx = (wq * q).sum(-1), (wq * xs).sum(-1)
        # sum wt (s q - x)^2 at the least-squares s = sqx / sqq, less sum wt x^2: -sqx^2 / sqq
        best = _keep_best(best, -safe_div(sqx * sqx, sqq), safe_div(sqx, sqq))
    return best[1]


def _keep_best(best: list | None, err: torch.Tensor, *values: torch.Tensor) -> list:
    """``[err, *values]`` where ``err`` is below ``best[0]`` (or everywhere when ``best`` is None),
    ``best`` elsewhere: the running pick of the searches above."""
    if best is None:
        return [err, *values]
    take = err < best[0]
    return [torch.where(take, new, old) for new, old in zip((err, *values), best)]
