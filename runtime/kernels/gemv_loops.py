"""The weight-only quantized inner loops of the decode GEMV (:mod:`.gemv`), as ``@triton.jit``
helpers its kernel calls: the math of one K step per weight kind, apart from the tiling, split-K,
epilogue and launch rules, which stay in :mod:`.gemv`.

* **int4, one row, float** (:func:`_int4_row`, :func:`_int4_step_float`): a nibble shifted to bits
  12..15 or 16..19 and OR-ed into the mantissa of 1.0 (:func:`_f12`, :func:`_f16`; ``M12`` /
  ``M16`` their masks) is ``1 + q · 2^-p`` exactly, so with the activations pre-scaled by ``2^p``
  a weight costs about 1.5 integer operations and one FMA, the ``Σ 2^p x`` and zero-point terms
  taken off per group and word.
* **int4, one row, integer dots** (:func:`_int4_step_dp4a`, :func:`_int4_step_dp4a_quads`,
  :func:`_int4_dp4a_core`, :func:`_dp4a`): each group's activations in 16-bit fixed point
  (``round(x · inv)``, ``|x · inv| ≤ 32767``, :func:`_fixed16_planes`) as high and low byte planes,
  and four ``dp4a`` a 32-bit word of codes; the group scale multiplies the integer sum once. The
  bytes may be made before (:func:`_pack_tile` / :func:`_pack_store` in a producer's epilogue,
  :mod:`.int4_acts`) and read here (:func:`_xpack_units`).
* **int4 codes in blocks of 128 inputs** (:func:`_kb_words`, the layout a CUDA bind stores) and
  act-order gathers of the activations (:func:`_x_at`).
* **int4, several rows** (:func:`_int4_k_loop`): 16-bit magic-number nibble planes into ``tl.dot``.
* **fp8, one row** (:func:`_fp8_row_loop`, :func:`_e4m3`): e4m3 codes shifted into float32 bits.
* **int8, one row** (:func:`_int8_row_loop`, :func:`_u8`): codes as the mantissa of a float32 in
  [1, 2) (the MoE experts' one-pair kernels, :mod:`.moe_gemv`; the dense GEMV takes int8 on the
  tensor cores).

The bits these loops give are checked against :mod:`graphdsl.quant`'s torch references by
``tests/kernels/test_quant_linear.py``, ``test_int4_acts.py`` and ``test_gemv.py`` (interpreter;
``tests/gpu/`` on the GPU).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f12(v, mask):
    """``1 + q * 2^-11`` for the nibble ``q`` in bits 12..15 of ``v``: the nibble as mantissa bits of
    a float32 in [1, 2) (one LOP3, no conversion instruction). ``mask`` is ``0xF000`` passed as a
    kernel argument: as a literal, ptxas re-materialised it before every other LOP3."""
    return ((v & mask) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _f16(v, mask):
    """``1 + q * 2^-7`` for the nibble ``q`` in bits 16..19 of ``v`` (as :func:`_f12`; ``mask`` 0xF0000)."""
    return ((v & mask) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _step_words(q_rows, c, w_hi, rc, C: tl.constexpr):
    """The fp8 one-row loop's ``[BLOCK_N, C]`` words from word ``c`` of each row, clamped to the slice's
    last ``C`` (the prefetch past the slice re-reads them): unmasked, so they may vectorize."""
    return tl.load(q_rows + (tl.minimum(c, w_hi - C) + rc)[None, :])


@triton.jit
def _int4_rows(q_ptr, rn, N, W_ROW, G: tl.constexpr, C: tl.constexpr, KB: tl.constexpr = False):
    """The int4 one-row loops' start, a step being ``G`` groups of ``C`` words of each row: the
    ``[G, C]`` word offsets of a step, the ``[G]`` group offsets, the rows as int64 indices (rows
    past ``N`` read row ``N - 1``, never stored) and ``[BLOCK_N, 1, 1]`` pointers to their first word
    (``KB``: in the first block, :func:`_kb_words`)."""
    rw = tl.arange(0, G)[:, None] * C + tl.arange(0, C)[None, :]
    rn64 = tl.minimum(rn, N - 1).to(tl.int64)
    if KB:
        return rw, tl.arange(0, G), rn64, q_ptr + rn64[:, None, None] * 16
    return rw, tl.arange(0, G), rn64, q_ptr + rn64[:, None, None] * W_ROW


@triton.jit
def _kb_words(kw, rows, UNIT: tl.constexpr):
    """Where element ``kw`` of a row lies, counted from that row's ``UNIT`` elements in the first block,
    for int4 codes stored in blocks (``scheme.blocked``, :func:`graphdsl.quant.int4_blocks`): each block
    holds ``UNIT`` elements of every one of the ``rows`` rows (64 bytes: 16 int32 or 32 int16 words, or 64
    bytes as bytes: :mod:`.quant_linear`),
    block after block, so block ``kw // UNIT`` starts ``rows * UNIT`` elements after the one before."""
    return (kw // UNIT) * (rows * UNIT) + kw % UNIT


@triton.jit
def _x_at(x_ptr, perm_ptr, k, PERM: tl.constexpr):
    """``x[k]``, or ``x[perm[k]]`` with ``PERM`` (act-order int4: input ``k`` of the groups)."""
    if PERM:
        k = tl.load(perm_ptr + k)
    return tl.load(x_ptr + k)


@triton.jit
def _int4_loads(x_ptr, s_ptr, z_ptr, q_rows, rw, rg, rn64, c, w_hi, stride_sn, S: tl.constexpr,
                GROUP: tl.constexpr, ZERO_POINT: tl.constexpr, XPACK: tl.constexpr = False, W_X=0,
                perm_ptr=None, PERM: tl.constexpr = False, X_WIDE: tl.constexpr = False,
                SC_QUAD: tl.constexpr = False, KB: tl.constexpr = False, KB_ROWS=1):
    """All that the step from word ``c`` reads, clamped to the slice's last ``S`` words (a prefetch
    past the slice re-reads them): the ``[BLOCK_N, G, C]`` words (unmasked, so 16-byte loads), the
    ``[BLOCK_N, G]`` scales and zero points (the scales again without ``ZERO_POINT``) and the eight
    ``[G, C]`` activation vectors of the words' inputs (word ``j`` holds inputs ``8j .. 8j + 7``).
    Issued one step ahead of their use: a load inside the step would stall it by a memory latency.
    With ``XPACK`` the activations come packed (:mod:`.int4_acts`, planes of ``W_X`` words): the
    words' ``[G, C]`` ``he, ho, le, lo, xs`` (then ``he`` three times, unused: the branches must
    return one shape; the groups' units come from :func:`_xpack_units`). With ``PERM`` input ``k``
    of the groups is ``x[perm[k]]`` (act-order), read through ``perm_ptr``. With ``X_WIDE`` (16-bit
    activations at an 8-byte aligned address) a word's eight activations come as two int64 loads
    (inputs ``8j .. 8j + 3`` and ``8j + 4 .. 8j + 7``, then the first six times, unused) instead of
    eight 16-bit ones: the loop is bound by its instructions, and this takes six loads off each of
    a thread's word columns a step (:func:`_x_lanes` unpacks them). With ``SC_QUAD`` the scales and
    zero points come ``[BLOCK_N, G, C / 4]``, each repeated for the four-word quads of the integer
    dots' accumulator: loaded in its shape they are loaded in its layout, where ``[BLOCK_N, G]``
    ones were moved into it through shared memory every step. ``KB``: the words stored in blocks of
    ``KB_ROWS`` rows (:func:`_kb_words`)."""
    c = tl.minimum(c, w_hi - S)
    if KB:
        w = tl.load(q_rows + _kb_words(c + rw, KB_ROWS, 16)[None, :, :])
    else:
        w = tl.load(q_rows + (c + rw)[None, :, :])
    sg = rn64[:, None] * stride_sn + ((8 * c) // GROUP + rg)[None, :]
    if SC_QUAD:
        sg = sg[:, :, None] + tl.zeros([1, 1, S // (4 * rg.shape[0])], tl.int64)   # [BLOCK_N, G, C / 4]
    sc = tl.load(s_ptr + sg)
    if ZERO_POINT:
        z = tl.load(z_ptr + sg)
    else:
        z = sc
    if XPACK:
        xq = x_ptr + c + rw
        he = tl.load(xq)
        return (w, sc, z, he, tl.load(xq + W_X), tl.load(xq + 2 * W_X), tl.load(xq + 3 * W_X),
                tl.load(xq + 4 * W_X), he, he, he)
    if PERM:
        k = 8 * (c + rw)
        return (w, sc, z, _x_at(x_ptr, perm_ptr, k, True), _x_at(x_ptr, perm_ptr, k + 1, True),
                _x_at(x_ptr, perm_ptr, k + 2, True), _x_at(x_ptr, perm_ptr, k + 3, True),
                _x_at(x_ptr, perm_ptr, k + 4, True), _x_at(x_ptr, perm_ptr, k + 5, True),
                _x_at(x_ptr, perm_ptr, k + 6, True), _x_at(x_ptr, perm_ptr, k + 7, True))
    if X_WIDE:
        xq = x_ptr.to(tl.pointer_type(tl.int64)) + 2 * (c + rw)
        lo = tl.load(xq)
        return w, sc, z, lo, tl.load(xq + 1), lo, lo, lo, lo, lo, lo
    else:
        xp = x_ptr + 8 * (c + rw)
        return (w, sc, z, tl.load(xp), tl.load(xp + 1), tl.load(xp + 2), tl.load(xp + 3), tl.load(xp + 4),
                tl.load(xp + 5), tl.load(xp + 6), tl.load(xp + 7))


@triton.jit
def _x_quad_loads(x_ptr, c, w_hi, rg, S: tl.constexpr):
    """The activations of the step from word ``c`` (clamped as :func:`_int4_loads` clamps) for
    :func:`_int4_step_dp4a_quads`, 16-bit at an 8-byte aligned address: for each word ``i`` of a
    quad (word ``4j + i`` of each group), its eight inputs as two int64, ``[G, C / 4]`` each:
    ``lo_0, hi_0, ..., lo_3, hi_3``. In the shape of the accumulator's quads, these small loads
    are made in its layout; the ``[G, C]`` ones of :func:`_int4_step_dp4a`, split into quads
    after their bytes were made, took shared-memory conversions every step. (The activations
    :func:`_int4_loads` returns beside them go unused, and the compiler drops their loads.)"""
    c = tl.minimum(c, w_hi - S)
    CQ: tl.constexpr = S // (4 * rg.shape[0])
    xq = x_ptr.to(tl.pointer_type(tl.int64)) + 2 * (c + rg[:, None] * (4 * CQ) + 4 * tl.arange(0, CQ)[None, :])
    return (tl.load(xq), tl.load(xq + 1), tl.load(xq + 2), tl.load(xq + 3), tl.load(xq + 4),
            tl.load(xq + 5), tl.load(xq + 6), tl.load(xq + 7))


@triton.jit
def _x_lanes(v, DT: tl.constexpr):
    """The four 16-bit floats (type ``DT``) of the int64 ``v``, lowest first, as float32."""
    lo = v.to(tl.int32)
    hi = (v >> 32).to(tl.int32)
    if DT == tl.bfloat16:      # a bfloat16 is the top half of its float32: one shift or mask each
        return ((lo << 16).to(tl.float32, bitcast=True), (lo & -65536).to(tl.float32, bitcast=True),
                (hi << 16).to(tl.float32, bitcast=True), (hi & -65536).to(tl.float32, bitcast=True))
    return (lo.to(tl.int16).to(DT, bitcast=True).to(tl.float32),
            (lo >> 16).to(tl.int16).to(DT, bitcast=True).to(tl.float32),
            hi.to(tl.int16).to(DT, bitcast=True).to(tl.float32),
            (hi >> 16).to(tl.int16).to(DT, bitcast=True).to(tl.float32))


@triton.jit
def _xpack_units(x_ptr, W_X, c, w_hi, rg, S: tl.constexpr, GROUP: tl.constexpr):
    """The ``[G]`` fixed-point units ``a`` of the step from word ``c`` (plane 5 of the packed
    activations, float32 bits), clamped as :func:`_int4_loads` clamps."""
    c = tl.minimum(c, w_hi - S)
    return tl.load(x_ptr + 5 * W_X + (8 * c) // GROUP + rg).to(tl.float32, bitcast=True)


@triton.jit
def _int4_row(x_ptr, q_ptr, s_ptr, z_ptr, rn, N, w_lo, w_hi, W_ROW, stride_sn, M12, M16, M0F,
              BLOCK_N: tl.constexpr, ZERO_POINT: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr,
              INT_DOT: tl.constexpr, EMULATE: tl.constexpr, XPACK: tl.constexpr = False, W_X=0,
              perm_ptr=None, PERM: tl.constexpr = False, X_WIDE: tl.constexpr = False,
              QUADS: tl.constexpr = False, KB: tl.constexpr = False):
    """One row (batch-1 decode): ``sum_k x[k] * (q[n, k] - z[n, g]) * s[n, g]`` over the words
    ``[w_lo, w_hi)`` of each weight row, on CUDA cores instead of ``tl.dot`` (whose operand-layout
    shuffle and int->float conversions bound the tensor-core path at one row). ``q_ptr``: int32
    words of eight nibbles, ``W_ROW`` a row (word ``c`` holds ``k = 8c + i`` in bits ``4i..4i+3``).
    A step's math is :func:`_int4_step_dp4a` (``INT_DOT``: integer dot products) or
    :func:`_int4_step_float` (float FMAs) into a ``[BLOCK_N, G, GROUP / 8]`` accumulator (a quarter
    as wide with integer dots: :func:`_int4_dp4a_core` sums four words first) reduced
    once, at the end.

    The slice is walked ``G`` groups a step (``G * GROUP / 2`` contiguous bytes of each row: the
    HBM stream is slower in short pieces, ``benchmarks/row_stream.py``), all that the next step
    reads — words, scales, activations (:func:`_int4_loads`) — loaded before this one's math: a
    plain loop's loads that feed no ``tl.dot`` are not software-pipelined. (Marking the loop
    ``tl.range(num_stages=s)`` makes Triton's pipeliner stream the words through shared memory,
    ``s - 1`` steps ahead, in fewer registers: slower on the H200 at every depth, gate_up 38.7 /
    31.0 / 32.9 µs at 2 / 3 / 4 against 30.2, qkv 11.4 / 10.0 / 10.4 against 9.2.) Weight
    loads carry no mask — rows past ``N`` read row ``N - 1`` (their sums are never stored) and the
    prefetch past the slice re-reads its last step — so they vectorize to 16-byte loads.

    ``XPACK``: ``x_ptr`` holds the activations already in the integer-dot loop's bytes
    (:func:`.int4_acts.pack_int4_activations`, ``W_X`` words a plane), made once by the kernel
    before instead of by every program each step; the sums are the same bits. ``PERM``: act-order,
    input ``k`` of the groups is ``x[perm[k]]``. ``X_WIDE``: the activations read as int64 words
    (:func:`_int4_loads`). ``QUADS``: with integer dots, the scales (``SC_QUAD``) and the 16-bit
    activations (``X_QUAD``: :func:`_x_quad_loads`, :func:`_int4_step_dp4a_quads`) loaded in the
    accumulator's layout. ``KB``: the words stored in blocks (``scheme.blocked``; the block's rows are
    ``N``'s, the weight's)."""
    C: tl.constexpr = GROUP // 8
    S: tl.constexpr = G * C
    SC_QUAD: tl.constexpr = QUADS and (XPACK or INT_DOT)
    X_QUAD: tl.constexpr = QUADS and INT_DOT and X_WIDE and not XPACK
    rw, rg, rn64, q_rows = _int4_rows(q_ptr, rn, N, W_ROW, G, C, KB)
    nw, ns, nz, n0, n1, n2, n3, n4, n5, n6, n7 = _int4_loads(x_ptr, s_ptr, z_ptr, q_rows, rw, rg, rn64, w_lo, w_hi,
                                                             stride_sn, S, GROUP, ZERO_POINT, XPACK, W_X, perm_ptr,
                                                             PERM, X_WIDE, SC_QUAD, KB, N)
    if X_QUAD:
        n0, n1, n2, n3, n4, n5, n6, n7 = _x_quad_loads(x_ptr, w_lo, w_hi, rg, S)
    if XPACK:
        na = _xpack_units(x_ptr, W_X, w_lo, w_hi, rg, S, GROUP)
    if XPACK or INT_DOT:
        acc = tl.zeros([BLOCK_N, G, C // 4], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, G, C], tl.float32)
    for c in range(w_lo, w_hi, S):
        w = nw
        if SC_QUAD:
            sc, z = ns.to(tl.float32), nz.to(tl.float32)
        else:
            sc, z = ns.to(tl.float32)[:, :, None], nz.to(tl.float32)[:, :, None]
        if XPACK:
            he, ho, le, lo, xs, a = n0, n1, n2, n3, n4, na
            na = _xpack_units(x_ptr, W_X, c + S, w_hi, rg, S, GROUP)
        elif X_QUAD:
            q0, q1, q2, q3, q4, q5, q6, q7 = n0, n1, n2, n3, n4, n5, n6, n7
        elif X_WIDE:
            x0, x1, x2, x3 = _x_lanes(n0, x_ptr.dtype.element_ty)
            x4, x5, x6, x7 = _x_lanes(n1, x_ptr.dtype.element_ty)
        else:
            x0, x1, x2, x3 = n0.to(tl.float32), n1.to(tl.float32), n2.to(tl.float32), n3.to(tl.float32)
            x4, x5, x6, x7 = n4.to(tl.float32), n5.to(tl.float32), n6.to(tl.float32), n7.to(tl.float32)
        nw, ns, nz, n0, n1, n2, n3, n4, n5, n6, n7 = _int4_loads(x_ptr, s_ptr, z_ptr, q_rows, rw, rg, rn64, c + S,
                                                                 w_hi, stride_sn, S, GROUP, ZERO_POINT, XPACK, W_X,
                                                                 perm_ptr, PERM, X_WIDE, SC_QUAD, KB, N)
        if X_QUAD:
            n0, n1, n2, n3, n4, n5, n6, n7 = _x_quad_loads(x_ptr, c + S, w_hi, rg, S)
        if XPACK:
            acc = _int4_dp4a_core(acc, w, sc, z, _quad2(he), _quad2(ho), _quad2(le), _quad2(lo), _quad_sum(xs),
                                  a[None, :, None], M0F, ZERO_POINT, EMULATE)
        elif X_QUAD:
            acc = _int4_step_dp4a_quads(acc, w, sc, z, q0, q1, q2, q3, q4, q5, q6, q7, M0F, ZERO_POINT, EMULATE,
                                        x_ptr.dtype.element_ty)
        elif INT_DOT:
            acc = _int4_step_dp4a(acc, w, sc, z, x0, x1, x2, x3, x4, x5, x6, x7, M0F, ZERO_POINT, EMULATE)
        else:
            acc = _int4_step_float(acc, w, sc, z, x0, x1, x2, x3, x4, x5, x6, x7, M12, M16, ZERO_POINT)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _int4_step_float(acc, w, sc, z, x0, x1, x2, x3, x4, x5, x6, x7, M12, M16, ZERO_POINT: tl.constexpr):
    """``acc [BLOCK_N, G, C]`` plus one step of :func:`_int4_row` with float FMAs: ``w`` the words,
    ``sc``/``z`` the ``[BLOCK_N, G, 1]`` scales and zero points, ``x0..x7`` the ``[G, C]`` float32
    activations of each word's eight inputs.

    Each nibble is brought to bits 12..15 or 16..19 by one of four shifts per word (``<< 12``,
    ``<< 8``, none, ``>> 8``, ``>> 16`` serve two planes each) and OR-ed into the mantissa of 1.0
    (:func:`_f12`, :func:`_f16`): ``f = 1 + q * 2^-p`` exactly, so ``sum f * x`` minus ``sum x`` is
    ``2^-p * sum q * x``; with the activations pre-scaled by ``2^p`` (per word, not per weight)
    one accumulator takes every plane: about 1.5 integer operations and one FMA per weight. Per
    group and word, ``sum 2^p x`` and the zero point's ``z * sum x`` are taken off and the scale
    applied (2 operations per 8 weights). Rounding: the float32 products carry ~2^-24 of
    ``2^11 |x|``, about 1e-4 of a word's ``sum q x`` — below the 16-bit activations' own rounding."""
    # the planes' activations pre-scaled by 2^p: f * (2^p x) = 2^p x + q x
    x0 *= 2048.0
    x1 *= 2048.0
    x2 *= 128.0
    x3 *= 2048.0
    x4 *= 128.0
    x5 *= 2048.0
    x6 *= 128.0
    x7 *= 2048.0
    wl8 = w << 8
    wr8 = w >> 8
    a = _f12(w << 12, M12) * x0[None] + _f12(wl8, M12) * x1[None] + _f16(wl8, M16) * x2[None] \
        + _f12(w, M12) * x3[None] + _f16(w, M16) * x4[None] + _f12(wr8, M12) * x5[None] \
        + _f16(wr8, M16) * x6[None] + _f12(w >> 16, M12) * x7[None]
    big = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7                            # sum 2^p x
    xs = (x0 + x1 + x3 + x5 + x7) * (1.0 / 2048.0) + (x2 + x4 + x6) * (1.0 / 128.0)   # sum x
    if ZERO_POINT:
        acc += sc * (a - big[None] - z * xs[None])     # sum (q - z) x per word
    else:
        acc += sc * (a - (big + 8.0 * xs)[None])
    return acc


@triton.jit
def _dp4a(a, b, c, SIGNED_B: tl.constexpr, EMULATE: tl.constexpr):
    """``c + sum_i a.byte[i] * b.byte[i]`` (int32): the bytes of ``a`` unsigned, of ``b`` signed with
    ``SIGNED_B``, else unsigned — one ``dp4a`` instruction (``EMULATE``: byte arithmetic, for the
    CPU interpreter, which runs no PTX)."""
    if EMULATE:
        r = c
        for i in tl.static_range(4):
            ai = (a >> (8 * i)) & 255
            if SIGNED_B:
                bi = (b << (24 - 8 * i)) >> 24
            else:
                bi = (b >> (8 * i)) & 255
            r += ai * bi
    elif SIGNED_B:
        r = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        r = tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                      is_pure=True, pack=1)
    return r


@triton.jit
def _byte_planes(q0, q2, q4, q6):
    """``(high, low)``: bytes 1 and bytes 0 of the 16-bit fixed-point ``q0, q2, q4, q6`` (int32)
    as bytes 0..3 of one int32 each — the signed high byte ``q >> 8`` and the low byte ``q & 255``
    of ``q = 256 h + l`` are bytes 1 and 0 of its two's complement. (Four ``prmt`` instructions
    make the same with fewer instructions in the loop; in the model it was no faster: H200, 8B int4
    2102 vs 2104 µs a step.)"""
    return (((q0 >> 8) & 255) | (((q2 >> 8) & 255) << 8) | (((q4 >> 8) & 255) << 16) | ((q6 >> 8) << 24),
            (q0 & 255) | ((q2 & 255) << 8) | ((q4 & 255) << 16) | (q6 << 24))


@triton.jit
def _max_nan(a, b):
    """``max(a, b)``, NaN if either is (a plain max returns the other operand)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fixed16_bits(x, inv):
    """``round(x * inv) + 0x4B400000`` as an int32 for ``|x * inv| < 2^15``: added to ``1.5 * 2^23``
    the float32's low mantissa bits are the rounded integer (no conversion instruction). The
    offset's low 16 bits are zero, so bytes 0 and 1 are those of the 16-bit integer, and eight of
    these sum to the integers' sum plus ``0x5A000000`` (int32, wrapping): no subtraction per input."""
    return (x * inv + 12582912.0).to(tl.int32, bitcast=True)


@triton.jit
def _fixed16_planes(x0, x1, x2, x3, x4, x5, x6, x7, inv):
    """A word's eight inputs in 16-bit fixed point (``round(x * inv)``, ``|x * inv| <= 32767``) as
    the integer-dot loop's bytes: ``(he, ho, le, lo, xs)``, the high (signed) and low bytes of the
    even and of the odd inputs four to an int32, and the sum of the eight integers."""
    r0, r1, r2, r3 = _fixed16_bits(x0, inv), _fixed16_bits(x1, inv), _fixed16_bits(x2, inv), _fixed16_bits(x3, inv)
    r4, r5, r6, r7 = _fixed16_bits(x4, inv), _fixed16_bits(x5, inv), _fixed16_bits(x6, inv), _fixed16_bits(x7, inv)
    he, le = _byte_planes(r0, r2, r4, r6)
    ho, lo = _byte_planes(r1, r3, r5, r7)
    return he, ho, le, lo, (r0 + r1 + r2 + r3) + (r4 + r5 + r6 + r7) - 0x5A000000


@triton.jit
def _abs_max8(x0, x1, x2, x3, x4, x5, x6, x7):
    """Elementwise ``max |x|`` of the eight input vectors, NaN where one is NaN."""
    return _max_nan(_max_nan(_max_nan(tl.abs(x0), tl.abs(x1)), _max_nan(tl.abs(x2), tl.abs(x3))),
                    _max_nan(_max_nan(tl.abs(x4), tl.abs(x5)), _max_nan(tl.abs(x6), tl.abs(x7))))


@triton.jit
def _finite_max(big, AXIS: tl.constexpr):
    """``max`` of ``big`` (non-negative) along ``AXIS``, NaN if any entry is not finite."""
    return tl.max(big, axis=AXIS) + tl.sum(big - big, axis=AXIS)


@triton.jit
def _group_amax(x0, x1, x2, x3, x4, x5, x6, x7, AXIS: tl.constexpr):
    """``max |x|`` over the eight input vectors and along ``AXIS`` (a group's words), NaN if any
    input is not finite: the scale of the packed activations (:mod:`.int4_acts`)."""
    return _finite_max(_abs_max8(x0, x1, x2, x3, x4, x5, x6, x7), AXIS)


@triton.jit
def _pack_store(out_ptr, W_X, c, x0, x1, x2, x3, x4, x5, x6, x7, amax, mask):
    """Store words ``c`` of the packed activations (:mod:`.int4_acts`: planes of ``W_X`` int32)
    made from their float32 inputs ``x0..x7`` (input ``8c + i``) and the groups' ``amax``
    (broadcast against ``c``): planes 0..4. Plane 5 (``amax / 32767``) is the caller's."""
    inv = tl.where(amax > 0, 32767.0 / tl.where(amax > 0, amax, 1.0), 0.0)   # (without a 1/0)
    he, ho, le, lo, xs = _fixed16_planes(x0, x1, x2, x3, x4, x5, x6, x7, inv)
    tl.store(out_ptr + c, he, mask=mask)
    tl.store(out_ptr + W_X + c, ho, mask=mask)
    tl.store(out_ptr + 2 * W_X + c, le, mask=mask)
    tl.store(out_ptr + 3 * W_X + c, lo, mask=mask)
    tl.store(out_ptr + 4 * W_X + c, xs, mask=mask)


@triton.jit
def _pack_tile(row, out_ptr, W_X, pid_n, N, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """The packed activations (:mod:`.int4_acts`) of one row's ``BLOCK_N`` columns of tile
    ``pid_n`` (``row``: float32 ``[BLOCK_N]``, whole groups of ``GROUP``), for the int4 GEMV that
    reads them next (:class:`GemvRmsOut` ``packed``): the inputs of each word are split out of the
    row by three halvings of ``[groups, words, 2, 2, 2]``."""
    NG: tl.constexpr = BLOCK_N // GROUP
    C: tl.constexpr = GROUP // 8
    ev, od = tl.split(tl.reshape(row, [NG, C, 2, 2, 2]))       # inputs 8c + (0, 2, 4, 6) / (1, 3, 5, 7)
    e0, e1 = tl.split(ev)
    o0, o1 = tl.split(od)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    amax = _group_amax(x0, x1, x2, x3, x4, x5, x6, x7, 1)
    c = pid_n * (BLOCK_N // 8) + tl.arange(0, NG)[:, None] * C + tl.arange(0, C)[None, :]
    _pack_store(out_ptr, W_X, c, x0, x1, x2, x3, x4, x5, x6, x7, amax[:, None], c < N // 8)
    g = pid_n * NG + tl.arange(0, NG)
    tl.store(out_ptr + 5 * W_X + g, (amax * (1.0 / 32767.0)).to(tl.int32, bitcast=True), mask=g < N // GROUP)


@triton.jit
def _int4_step_dp4a(acc, w, sc, z, x0, x1, x2, x3, x4, x5, x6, x7, M0F, ZERO_POINT: tl.constexpr,
                    EMULATE: tl.constexpr):
    """``acc`` plus one step of :func:`_int4_row` (arguments as :func:`_int4_step_float`), with
    integer dot products: per group the activations become 16-bit fixed point, ``x ~ a * xq`` with
    ``a = max|x_g| / 32767`` and ``xq = round(x / a)`` (error at most ``a / 2`` an input: ``2^-16``
    of the group's largest, far below the 16-bit activations' own rounding), split into a signed
    high and an unsigned low byte (``xq = 256 h + l``) and packed four to an int32 for the even and
    for the odd inputs of a word. A weight word's even and odd nibbles are two ``& 0x0F0F0F0F``
    byte vectors, so a word's ``sum_i q_i xq_i`` is four ``dp4a`` (exact: below 2^22), about 0.9
    instructions a weight where the float loop spends 2.5. Per word the zero point comes off as
    ``z * sum_i xq_i`` (the symmetric 8 in the integer sum, with the high bytes' scaling) and the
    float32 accumulator takes ``s[n, g] * a`` times the converted sum. A group with a NaN or
    infinite input gives NaN.

    Each thread makes the activation bytes of its own words' columns, per group: compiled for
    sm_90 (one group a step), 2.5 SASS instructions a weight in the loop against the float loop's
    3.6 — alone no faster on the H200; with the loads a step ahead (:func:`_int4_loads`) faster.
    """
    amax = _group_amax(x0, x1, x2, x3, x4, x5, x6, x7, 1)     # [G]; NaN if an input is not finite
    inv = tl.where(amax > 0, 32767.0 / amax, 0.0)[:, None]
    he, ho, le, lo, xs = _fixed16_planes(x0, x1, x2, x3, x4, x5, x6, x7, inv)
    return _int4_dp4a_core(acc, w, sc, z, _quad2(he), _quad2(ho), _quad2(le), _quad2(lo), _quad_sum(xs),
                           (amax * (1.0 / 32767.0))[None, :, None], M0F, ZERO_POINT, EMULATE)


@triton.jit
def _quad_inputs(lo, hi, DT: tl.constexpr):
    """A word's eight 16-bit inputs (type ``DT``) from its two int64 (:func:`_x_quad_loads`), as float32."""
    x0, x1, x2, x3 = _x_lanes(lo, DT)
    x4, x5, x6, x7 = _x_lanes(hi, DT)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int4_step_dp4a_quads(acc, w, sc, z, l0, h0, l1, h1, l2, h2, l3, h3, M0F, ZERO_POINT: tl.constexpr,
                          EMULATE: tl.constexpr, DT: tl.constexpr):
    """:func:`_int4_step_dp4a` on activations that come a quad's word at a time (:func:`_x_quad_loads`:
    ``l_i, h_i`` the two int64 of word ``4j + i``, ``[G, C / 4]``), ``sc``/``z`` ``[BLOCK_N, G, C / 4]``:
    the same fixed point, bytes and sums (the same bits). Each thread makes the bytes of its own
    quads' 32 inputs — four times the inputs a thread made per word before (642 SASS instructions a
    step for the 8B qkv launch against 458), with no shared-memory conversion between the bytes and
    the ``dp4a`` (12 ``BAR.SYNC`` a step before): faster in the model (``_QUADS``)."""
    big = _max_nan(_max_nan(_abs_max8(*_quad_inputs(l0, h0, DT)), _abs_max8(*_quad_inputs(l1, h1, DT))),
                   _max_nan(_abs_max8(*_quad_inputs(l2, h2, DT)), _abs_max8(*_quad_inputs(l3, h3, DT))))
    amax = _finite_max(big, 1)               # [G]; NaN if an input is not finite
    inv = tl.where(amax > 0, 32767.0 / amax, 0.0)[:, None]
    he0, ho0, le0, lo0, xs0 = _fixed16_planes(*_quad_inputs(l0, h0, DT), inv)
    he1, ho1, le1, lo1, xs1 = _fixed16_planes(*_quad_inputs(l1, h1, DT), inv)
    he2, ho2, le2, lo2, xs2 = _fixed16_planes(*_quad_inputs(l2, h2, DT), inv)
    he3, ho3, le3, lo3, xs3 = _fixed16_planes(*_quad_inputs(l3, h3, DT), inv)
    return _int4_dp4a_core(acc, w, sc, z, (he0, he1, he2, he3), (ho0, ho1, ho2, ho3), (le0, le1, le2, le3),
                           (lo0, lo1, lo2, lo3), (xs0 + xs1) + (xs2 + xs3), (amax * (1.0 / 32767.0))[None, :, None],
                           M0F, ZERO_POINT, EMULATE)


@triton.jit
def _quad_sum(xs):
    """``[G, C / 4]``: the sums of ``xs [G, C]`` over each quad of words."""
    x0, x1, x2, x3 = _quad2(xs)
    return (x0 + x1) + (x2 + x3)


@triton.jit
def _int4_dp4a_core(acc, w, sc, z, he, ho, le, lo, xs4, a, M0F, ZERO_POINT: tl.constexpr, EMULATE: tl.constexpr):
    """The integer dot products of :func:`_int4_step_dp4a`: ``he``/``ho`` and ``le``/``lo`` the
    high and low activation bytes of each word's even / odd inputs, each a tuple of the four
    ``[G, C / 4]`` words of a quad (:func:`_quad2`), ``xs4`` the quads' fixed-point sums, ``a`` the
    groups' fixed-point unit ``max|x_g| / 32767`` (broadcast against ``[BLOCK_N, G, C / 4]``).

    Four neighbouring words (a quad, 32 inputs of one group) share one conversion and
    multiply-add: the ``dp4a`` of their high bytes chain into one sum, those of their low bytes into
    another (each ``dp4a`` takes the previous one as its addend), and ``256 · high + low`` is the
    quad's integer dot product: below 2^24 in magnitude (``|q| <= 15``, 32 inputs of ``|xq| <=
    32767``; with the symmetric zero point taken off, ``|q - 8| <= 8``), so exact in float32.
    ``acc`` is ``[BLOCK_N, G, C / 4]``. A thread's four words are neighbours in the compiled
    layout, so the weights' splits move no data. Activation bytes made as ``[G, C]`` and split
    into quads are moved through shared memory (a few barriers a step: 456 instructions a step for
    the 8B qkv launch, against 640 before the chain, the raw-bit bytes (:func:`_fixed16_bits`) and
    the bfloat16 lane split (:func:`_x_lanes`)); made a quad's word at a time
    (:func:`_int4_step_dp4a_quads`) they are not (docs/quantization-log.md, ``benchmarks/loop_sass.py``)."""
    we = w & M0F                    # nibbles 0, 2, 4, 6 (k = 8c, 8c+2, ...) as bytes
    wo = (w >> 4) & M0F             # nibbles 1, 3, 5, 7
    e0, e1, e2, e3 = _quad3(we)
    o0, o1, o2, o3 = _quad3(wo)
    h = _dp4a_quad(e0, e1, e2, e3, he[0], he[1], he[2], he[3], tl.zeros_like(e0), True, EMULATE)
    h = _dp4a_quad(o0, o1, o2, o3, ho[0], ho[1], ho[2], ho[3], h, True, EMULATE)
    v = _dp4a_quad(e0, e1, e2, e3, le[0], le[1], le[2], le[3], h * 256, False, EMULATE)
    v = _dp4a_quad(o0, o1, o2, o3, lo[0], lo[1], lo[2], lo[3], v, False, EMULATE)
    sc = sc * a
    if ZERO_POINT:
        acc += (v.to(tl.float32) - z * xs4.to(tl.float32)[None]) * sc
    else:
        acc += (v - 8 * xs4[None]).to(tl.float32) * sc    # the symmetric zero point
    return acc


@triton.jit
def _dp4a_quad(w0, w1, w2, w3, x0, x1, x2, x3, acc, SIGNED: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + Σ_j dp4a(w_j, x_j)`` over a quad's four words (``x_j`` ``[G, C / 4]``, broadcast
    over the rows of ``w_j``), each ``dp4a`` the next one's addend."""
    acc = _dp4a(w0, x0[None], acc, SIGNED, EMULATE)
    acc = _dp4a(w1, x1[None], acc, SIGNED, EMULATE)
    acc = _dp4a(w2, x2[None], acc, SIGNED, EMULATE)
    return _dp4a(w3, x3[None], acc, SIGNED, EMULATE)


@triton.jit
def _quad3(t):
    """Words ``4j, 4j + 1, 4j + 2, 4j + 3`` of ``t [BLOCK_N, G, C]``, each ``[BLOCK_N, G, C / 4]``."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2] // 4, 2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _quad2(t):
    """Words ``4j .. 4j + 3`` of ``t [G, C]``, each ``[G, C / 4]``."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1] // 4, 2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _e4m3(top):
    """An fp8 e4m3 code in bits 24..31 of ``top`` (the rest zero) as a float32: the arithmetic shift
    by 4 puts the exponent and mantissa at bits 20..26 and copies the sign into 27..31, the mask
    keeps bit 31: the float32 is the code times 2^-120 exactly — a code with exponent 0
    (subnormal) lands on a float32 subnormal of the same ratio."""
    return ((top >> 4) & -2014314496).to(tl.float32, bitcast=True)     # 0x87F00000


@triton.jit
def _word_inputs(x_ptr, c, rc, X_WIDE: tl.constexpr):
    """The four float32 activations of words ``c + rc`` of four codes each (word ``j`` holds inputs
    ``4j .. 4j + 3``): with ``X_WIDE`` (16-bit activations at an 8-byte aligned address) one int64
    load a word, else four loads."""
    if X_WIDE:
        x0, x1, x2, x3 = _x_lanes(tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + c + rc), x_ptr.dtype.element_ty)
    else:
        xp = x_ptr + 4 * (c + rc)
        x0 = tl.load(xp).to(tl.float32)
        x1 = tl.load(xp + 1).to(tl.float32)
        x2 = tl.load(xp + 2).to(tl.float32)
        x3 = tl.load(xp + 3).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def _fp8_row_loop(x_ptr, q_ptr, rn, N, w_lo, w_hi, W_ROW, BLOCK_N: tl.constexpr, C: tl.constexpr,
                  X_WIDE: tl.constexpr = False):
    """One row: ``2^-120 · sum_k x[k] · q[n, k]`` over the words ``[w_lo, w_hi)`` of each row (the
    caller multiplies by ``2^120`` and the scales). ``q_ptr``: int32 words of four e4m3 codes
    (``k = 4c + i`` in byte ``i``). Each code becomes a float32 by shifts and one LOP3
    (:func:`_e4m3`) instead of the conversion instructions (16 a clock per SM on Hopper, which held
    the ``tl.dot`` path near half the copy bandwidth), then one FMA; float32 subnormal products
    keep an absolute precision of 2^-29 of the code scale. Words are ``C`` a step, the next step's
    loaded before this one's math, rows past ``N`` read row ``N - 1`` (never stored): unmasked
    16-byte loads. (Slower on the H200: prefetching the activations too, as the int4 loops do — o
    8.5 -> 10.1 µs, down 20.5 -> 24.8 —, and streaming the words through the loop pipeliner, as
    :func:`_int4_row` tells, 3 stages: qkv 11.2 -> 12.2, o 8.5 -> 9.5, gate_up 35.6 -> 37.8, down
    20.5 -> 22.1.)"""
    return _code_word_loop(x_ptr, q_ptr, rn, N, w_lo, w_hi, W_ROW, 0, BLOCK_N, C, X_WIDE, False)


@triton.jit
def _u8(v, MASK):
    """``1 + u · 2^-8`` for ``u = b ^ 0x80`` — an int8 code ``b`` plus 128 — when ``v`` holds ``b`` in bits
    15..22: the byte as the top mantissa bits of a float32 in [1, 2), its sign bit flipped by the
    same LOP3 (``MASK`` is ``0x7F8000`` passed as a kernel argument, as :func:`_f12`'s)."""
    return ((v & MASK) ^ 0x3FC00000).to(tl.float32, bitcast=True)


@triton.jit
def _int8_row_loop(x_ptr, q_ptr, rn, N, w_lo, w_hi, W_ROW, M8, BLOCK_N: tl.constexpr, C: tl.constexpr,
                   X_WIDE: tl.constexpr = False):
    """One row: ``2^-8 · sum_k x[k] · q[n, k]`` over the words ``[w_lo, w_hi)`` of each row (the
    caller multiplies by ``2^8`` and the scales). ``q_ptr``: int32 words of four int8 codes (``k =
    4c + i`` in byte ``i``). Each code is shifted to bits 15..22 and made ``f = 1 + (q + 128) / 256``
    by one LOP3 (:func:`_u8`), no conversion instruction, then one FMA; ``f · x`` sums to ``x +
    (q + 128) x / 256``, so each step takes off ``1.5 · Σ x`` of its words (float32 sums stay near
    the result's size). Words are ``C`` a step, the next step's loaded before this one's math, as
    :func:`_fp8_row_loop`'s."""
    return _code_word_loop(x_ptr, q_ptr, rn, N, w_lo, w_hi, W_ROW, M8, BLOCK_N, C, X_WIDE, True)


@triton.jit
def _code_word_loop(x_ptr, q_ptr, rn, N, w_lo, w_hi, W_ROW, M8, BLOCK_N: tl.constexpr, C: tl.constexpr,
                    X_WIDE: tl.constexpr, INT8: tl.constexpr):
    """The loop of :func:`_fp8_row_loop` and :func:`_int8_row_loop` (``INT8``): ``[BLOCK_N, C]`` float32
    sums of each row's words ``[w_lo, w_hi)``, ``C`` a step, the next step's words loaded before this
    one's math, reduced along the words at the end."""
    rc = tl.arange(0, C)
    q_rows = q_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * W_ROW    # rows past N read row N - 1
    w_next = _step_words(q_rows, w_lo, w_hi, rc, C)
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    for c in range(w_lo, w_hi, C):
        w = w_next
        w_next = _step_words(q_rows, c + C, w_hi, rc, C)
        x0, x1, x2, x3 = _word_inputs(x_ptr, c, rc, X_WIDE)
        if INT8:
            acc += _u8(w << 15, M8) * x0[None, :] + _u8(w << 7, M8) * x1[None, :] + _u8(w >> 1, M8) * x2[None, :] \
                + _u8(w >> 9, M8) * x3[None, :] - (1.5 * (x0 + x1 + x2 + x3))[None, :]
        else:
            acc += _e4m3(w << 24) * x0[None, :]
            acc += _e4m3(w << 16) * x1[None, :]
            acc += _e4m3(w << 8) * x2[None, :]
            acc += _e4m3(w) * x3[None, :]          # byte 3: its low bits below 24 come out of the mask
    return tl.sum(acc, axis=1)


@triton.jit
def _int4_k_loop(acc, x_rows, q_ptr, s_ptr, z_ptr, rn, n_ok, m_ok, k_lo, k_hi, K, stride_sn,
                 ZERO_POINT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                 perm_ptr=None, PERM: tl.constexpr = False, KB: tl.constexpr = False, KB_ROWS=1):
    """``acc[n, m] += sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g]`` over ``k_lo <= k < k_hi``,
    ``g = k // GROUP`` (``z = 8`` without zero points), ``q_ptr`` the codes as int16 words of four
    nibbles (word ``c`` holds ``k = 4c + i`` in bits ``4i..4i+3``).

    A K step of ``BLOCK_K`` inputs covers ``BLOCK_K / GROUP`` whole groups (or lies in one). Per
    group, each nibble plane ``i`` (a ``[BLOCK_N, STEP / 4]`` tile) enters a ``tl.dot`` with the
    activations ``x[:, 4c + i]``, and the group's scale multiplies the float32 partial — no nibble
    interleave, no per-weight scale multiply. The plane becomes 16-bit floats without a conversion
    instruction (those run at 1/8 of the FMA rate on Hopper and bound a plain cast): ``nibble | MAGIC``
    is the bit pattern of ``M + nibble`` (bf16 ``0x4300`` = 128, fp16 ``0x6400`` = 1024; exact: the
    unit in the last place there is 1). The dot takes ``M + q`` as it is (16-bit float arithmetic
    may itself go through conversions) and ``(M + z) * sum_k x[m, k]`` over the group is taken off
    the float32 partial: the products are exact and the float32 sums carry ~2^-17 of
    ``sum |x|``, far below the 16-bit activations' own rounding. ``PERM``: act-order, input ``k`` of
    the groups is ``x[:, perm[k]]``."""
    STEP: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP       # inputs per group step
    SUBS: tl.constexpr = BLOCK_K // STEP
    QUARTER: tl.constexpr = STEP // 4
    rc = tl.arange(0, QUARTER)
    rn64 = rn.to(tl.int64)
    if KB:                                       # stored in blocks of KB_ROWS rows (_kb_words)
        q_rows = q_ptr + rn64[:, None] * 32
    else:
        q_rows = q_ptr + rn64[:, None] * (K // 4)
    s_rows = s_ptr + rn64 * stride_sn
    z_rows = z_ptr + rn64 * stride_sn
    xdt = x_rows.dtype.element_ty
    BF16: tl.constexpr = xdt == tl.bfloat16
    MAGIC_BITS: tl.constexpr = 0x4300 if BF16 else 0x6400
    MAGIC: tl.constexpr = 128.0 if BF16 else 1024.0
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for j in tl.static_range(SUBS):
            kb = k0 + j * STEP
            ok = (kb + 4 * rc) < K                                       # whole groups: all or none
            if KB:
                w = tl.load(q_rows + _kb_words(kb // 4 + rc, KB_ROWS, 32)[None, :], mask=n_ok[:, None] & ok[None, :],
                            other=0)
            else:
                w = tl.load(q_rows + (kb // 4 + rc)[None, :], mask=n_ok[:, None] & ok[None, :], other=0)
            g = kb // GROUP
            g_ok = n_ok & ((rn * 0 + kb) < K)
            s = tl.load(s_rows + g, mask=g_ok, other=0.0).to(tl.float32)
            if ZERO_POINT:
                z = tl.load(z_rows + g, mask=g_ok, other=0.0).to(tl.float32)
            else:
                z = tl.full([rn.shape[0]], 8.0, tl.float32)
            part = tl.zeros_like(acc)
            xsum = tl.zeros([acc.shape[1]], tl.float32)
            for i in tl.static_range(4):
                ki = kb + 4 * rc + i
                if PERM:
                    ki = tl.load(perm_ptr + ki, mask=ok, other=0)
                xi = tl.load(x_rows + ki[None, :], mask=m_ok[:, None] & ok[None, :], other=0.0)
                nib = (w >> (4 * i)) & 15
                if DOT_F32:
                    part += tl.dot(nib.to(tl.float32) - z[:, None], tl.trans(xi.to(tl.float32)), input_precision="ieee")
                else:
                    part += tl.dot((nib | MAGIC_BITS).to(tl.int16).to(xdt, bitcast=True), tl.trans(xi))
                    xsum += tl.sum(xi.to(tl.float32), axis=1)
            if not DOT_F32:
                part -= (z + MAGIC)[:, None] * xsum[None, :]                # sum (M + q) x - (M + z) sum x
            acc += part * s[:, None]
    return acc
