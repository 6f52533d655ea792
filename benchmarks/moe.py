"""Sparse MoE experts (runtime/kernels/moe.py) at real sizes: µs per call (replayed from a CUDA
graph, as decode runs it) and GB/s of the chosen experts' weights, against the measured copy
bandwidth; ``--sweep`` tries the grouped kernels' launch configs (for GGUF stacks, their tile
kernels': rows a program, values a K step, warps, stages; Q4_K / Q6_K ones, ``moe_gguf_mma``'s with 32-value
steps); ``--schemes`` adds the stacks stored quantized
(``quant_moe_experts``), each row with its speed against bf16's at the same token count (with
``--sweep``, the launch configs are then swept for those schemes, not for bf16).

    python benchmarks/moe.py [--shape mixtral|deepseek-v2-lite|qwen2-moe] [--tokens 1 8 64] [--sweep]
                             [--schemes int4-g128 int8-channel fp8-channel gguf-q4_k/gguf-q6_k]

Bytes per call = the distinct experts the tokens chose x their stored bytes (bf16: 3 x hidden x
intermediate x 2; a scheme: its codes, scales and zero points): the least any kernel must read.
Routing is uniform at random (as with random weights).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, device_line  # noqa: E402


def _graph_us(fn) -> float:
    """µs of one call replayed from a CUDA graph (how decode runs it: no host launch cost)."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")

# experts, top-k, hidden, intermediate (published configs)
SHAPES = {"mixtral": (8, 2, 4096, 14336), "deepseek-v2-lite": (64, 6, 2048, 1408), "qwen2-moe": (60, 4, 2048, 1408)}


def _case(tokens, e, k, h, i, gen):
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate_up = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    scores = torch.rand(tokens, e, device="cuda", generator=gen)
    w, ids = scores.topk(k, -1)
    routing = torch.zeros_like(scores).scatter_(1, ids, w)
    used = int((routing > 0).any(0).sum())
    return (x, routing, gate_up, down), used * 3 * h * i * 2


def _schemes(scheme: str) -> tuple:
    """The (gate/up, down) schemes of ``scheme``: one name for both stacks, or ``up/down``
    (``gguf-q4_k/gguf-q6_k``: a Q4_K_M file's experts)."""
    from graphdsl.quant import parse_scheme
    up, _, down = scheme.partition("/")
    return parse_scheme(up), parse_scheme(down or up)


def _quantized(scheme: str, ops, used: int):
    """``(call, bytes, stacks)``: :func:`quant_moe_experts` over ``ops``' stacks stored in ``scheme``
    (:func:`_schemes`), the stored bytes of ``used`` experts, and the (gate/up, down) stacked companions."""
    from graphdsl.runtime.kernels.moe import quant_moe_experts
    x, routing, gate_up, down = ops
    su, sd = _schemes(scheme)
    up, dn = su.quantize_stack(gate_up), sd.quantize_stack(down)
    per_expert = sum(t[0].numel() * t.element_size() for t in up + dn)
    call = (lambda k, cfg=None, gemv=None: quant_moe_experts(x, routing, up, dn, schemes=(su, sd), top_k=k,
                                                          config=cfg, gemv=gemv))
    return call, used * per_expert, (up, dn)


def _picks_gemv(scheme: str, stacks, pairs: int, experts: int) -> bool:
    """Whether :func:`quant_moe_experts` runs ``pairs`` of ``scheme`` one pair a program row by default
    (bf16 activations)."""
    from graphdsl.runtime.kernels.moe import _Stack, one_pair_by_default
    return one_pair_by_default(*(_Stack.of(s, st) for s, st in zip(_schemes(scheme), stacks)), pairs, experts,
                               torch.bfloat16)


def _tensor_cores(scheme: str, stacks, ops, k: int) -> bool:
    """Whether the one-pair path runs ``scheme``'s GGUF stacks on the int8 tensor cores (``moe_gguf_mma``,
    or ``moe_gguf_rows`` for Q5_K / Q8_0 stacks) at top-``k``."""
    from graphdsl.runtime.kernels import moe_gguf
    from graphdsl.runtime.kernels.moe import _Stack
    x, _, gate_up, down = ops
    up, dn = (_Stack.of(s, st) for s, st in zip(_schemes(scheme), stacks))
    hidden, inter = gate_up.shape[2], down.shape[2]
    return (bool(up.qtype) and moe_gguf.MMA
            and (moe_gguf.mma_eligible(up, dn, hidden, inter, x.dtype)
                 or moe_gguf.rows_eligible(up, dn, hidden, inter, x.dtype, x.shape[0], k)))


def _grouped_planes(scheme: str, stacks, ops) -> bool:
    """Whether the grouped kernels take ``scheme``'s GGUF stacks a 32-value plane a K step
    (``moe_gguf_mma.planes_eligible``: Q4_K, Q5_K, Q6_K, Q8_0)."""
    from graphdsl.runtime.kernels import moe_gguf
    from graphdsl.runtime.kernels.moe import _Stack
    x, _, gate_up, down = ops
    up, dn = (_Stack.of(s, st) for s, st in zip(_schemes(scheme), stacks))
    return (bool(up.qtype) and moe_gguf.MMA
            and moe_gguf.planes_eligible(up, dn, gate_up.shape[2], down.shape[2], x.dtype))


def _paths(scheme: str, call, k: int, picked: bool, tensor_cores: bool) -> list[tuple[str, float]]:
    """``[(path, µs)]``: one pair a program row (with ``tensor_cores``, on the int8 tensor cores and
    then on the CUDA cores, ``moe_gguf.MMA`` off), then grouped (for Q4_K / Q6_K stacks, which the
    grouped plane kernels decode by packed PTX, also with the float32 decode, ``gguf_linear._FAST_PLANES``
    off), the default marked."""
    from graphdsl.runtime.kernels import gguf_linear, moe_gguf
    rows = []
    for gemv in (True, False):
        label = ("one pair a row" if gemv else "grouped") + (", int8 tensor cores" if gemv and tensor_cores else "")
        rows.append((label + (" (default)" if gemv == picked else ""), _graph_us(lambda: call(k, gemv=gemv))))
        if gemv and tensor_cores:
            moe_gguf.MMA = False
            try:
                rows.append(("one pair a row, CUDA cores", _graph_us(lambda: call(k, gemv=True))))
            finally:
                moe_gguf.MMA = True
        if not gemv and tensor_cores:           # Q4_K / Q6_K stacks: their planes' decode A/B
            gguf_linear._FAST_PLANES = False
            try:
                rows.append(("grouped, float32 plane decode", _graph_us(lambda: call(k, gemv=False))))
            finally:
                gguf_linear._FAST_PLANES = True
    return rows


def main(argv=None) -> int:
    from graphdsl.runtime.kernels.moe import _pick_config, moe_experts
    from graphdsl.runtime.kernels.moe_gguf import grouped_config
    from graphdsl.runtime.kernels.moe_gguf_mma import grouped_config as plane_grouped_config
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--sweep", action="store_true", help="try launch configs (gate/up, then down)")
    ap.add_argument("--schemes", nargs="*", default=[], help="also time the stacks stored in these schemes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    e, k, h, i = SHAPES[args.shape]
    copy = copy_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{args.shape}: {e} experts, top-{k}, hidden {h}, intermediate {i}, bf16 activations on {device_line()}; "
          f"copy {copy:.0f} GB/s\n")
    if args.schemes:
        print("| tokens | weights | kernels | µs | GB/s | % of copy | x bf16 speed |\n"
              "|---:|---|---|---:|---:|---:|---:|")
        for t in args.tokens:
            ops, nbytes = _case(t, e, k, h, i, gen)
            base = _graph_us(lambda: moe_experts(*ops, top_k=k))
            print(f"| {t} | bf16 | grouped | {base:.1f} | {nbytes / base / 1e3:.0f} | "
                  f"{100 * nbytes / base / 1e3 / copy:.1f}% | 1.00 |", flush=True)
            for scheme in args.schemes:
                call, qbytes, stacks = _quantized(scheme, ops, nbytes // (3 * h * i * 2))
                for path, us in _paths(scheme, call, k, _picks_gemv(scheme, stacks, t * k, e),
                                       _tensor_cores(scheme, stacks, ops, k)):
                    print(f"| {t} | {scheme} | {path} | {us:.1f} | {qbytes / us / 1e3:.0f} | "
                          f"{100 * qbytes / us / 1e3 / copy:.1f}% | {base / us:.2f} |", flush=True)
        if not args.sweep:
            return 0
        print()
    tiles = list(itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 5)))
    gguf_tiles = list(itertools.product((16, 32, 64), (256,), (4, 8), (1, 2)))   # GGUF: (.., values a K step, ..)
    plane_tiles = list(itertools.product((32, 64, 128), (32,), (4, 8), (2, 3)))   # GGUF on moe_gguf_mma: planes
    print("| tokens | weights | config | µs | GB/s | % of copy |\n|---:|---|---|---:|---:|---:|")
    for t in args.tokens:
        ops, nbytes = _case(t, e, k, h, i, gen)
        runs = [] if args.schemes else [("bf16", lambda cfg: moe_experts(*ops, top_k=k, config=cfg), nbytes, False)]
        for scheme in args.schemes:
            call, qbytes, stacks = _quantized(scheme, ops, nbytes // (3 * h * i * 2))
            runs.append((scheme, lambda cfg, call=call: call(k, cfg, gemv=False), qbytes,
                         _grouped_planes(scheme, stacks, ops)))
        for name, run, size, planes in runs:
            gguf = name.startswith("gguf")
            if planes:
                base, sweep = plane_grouped_config(t * k), plane_tiles
            elif gguf:
                base, sweep = grouped_config(t * k), gguf_tiles
            else:
                base, sweep = _pick_config(t * k, int4=name.startswith("int4")), tiles
            for label, (ms, cfg) in _configs(run, base, sweep if args.sweep else None):
                print(f"| {t} | {name} | {label} {cfg} | {ms * 1e3:.1f} | {size / ms / 1e6:.0f} | "
                      f"{100 * size / ms / 1e6 / copy:.1f}% |", flush=True)
    return 0


def _configs(run, base, tiles):
    """``[("default", (ms, config))]``, and with ``tiles`` the best of gate/up's tiles, then of
    down's with that gate/up, then of 16 to 128 rows a block with both, as ``("best", ...)``."""
    from graphdsl.runtime.kernels.moe import MoeConfig

    def ms(cfg):
        try:
            return _graph_us(lambda: run(cfg)) / 1e3
        except Exception as exc:   # a config the compiler rejects (shared memory)
            print(f"| {cfg} | failed: {type(exc).__name__}: {str(exc)[:120]} |", file=sys.stderr)
            return float("inf")

    rows = [("default", (ms(base), base))]
    if tiles is None:
        return rows
    best = rows[0][1]
    for which in ("up", "down"):
        for tile in tiles:
            cfg = MoeConfig(base.block_m, tile, best[1].down) if which == "up" else MoeConfig(base.block_m, best[1].up, tile)
            best = min(best, (ms(cfg), cfg), key=lambda r: r[0])
    for block_m in (16, 32, 64, 128):
        cfg = MoeConfig(block_m, best[1].up, best[1].down)
        best = min(best, (ms(cfg), cfg), key=lambda r: r[0])
    return rows + [("best", best)]


if __name__ == "__main__":
    sys.exit(main())
