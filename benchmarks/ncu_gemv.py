"""Why a decode GEMV streams below the copy bandwidth: Nsight Compute's counters for one launch.

    python benchmarks/ncu_gemv.py [--cases int4:8b.down fp8:8b.down bf16:8b.down ...] [--ncu PATH]

Each case is ``scheme:projection`` — ``bf16``, ``int4`` (g128) or ``fp8`` (per channel) weights of a
projection of ``benchmarks/gemv.py``'s ``SHAPES`` (gate/up with its SwiGLU epilogue) — at one row, the
launch ``gemv`` picks, the activations made in the loop (no packed ``xpack``); or ``q4_k`` / ``q6_k``
GGUF blocks (random, block-major as a CUDA bind stores them) on the tensor-core GEMV
(``gguf_gemv``'s launch), its activation operand made beforehand as the model's producers make it. The script runs
itself under ``ncu`` once per case (``--clock-control none``: the clocks the model runs at; the
fourth launch is profiled, caches flushed before it, so the weights stream from HBM) and prints a
table: time, DRAM bytes per µs and percent of the DRAM peak, the share of cycles each scheduler
issued, warps resident per scheduler, and the stall reasons, in cycles per issued instruction, that
take at least 0.1 (``long_scoreboard``: waiting on a global load; ``barrier``: a ``bar.sync``, the
layout conversions through shared memory; ``short_scoreboard``: shared memory or MUFU results;
``wait``: fixed-latency dependences). One launch alone, without the PDL overlap of the model: read
it beside ``decode_ab.py``, not instead of it. Needs a CUDA GPU and ``ncu`` (CUDA's
``/usr/local/cuda/bin/ncu`` by default) with access to the performance counters.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv import SHAPES  # noqa: E402

SCHEMES = {"bf16": None, "int4": "int4-g128", "fp8": "fp8-channel", "q4_k": "Q4_K", "q6_k": "Q6_K"}
GGUF = ("q4_k", "q6_k")
KERNELS = {"q4_k": "_q4k_kernel", "q6_k": "_q6k_kernel"}     # the profiled kernel (default: _gemv_kernel)
STALLS = ("long_scoreboard", "barrier", "short_scoreboard", "wait", "math_pipe_throttle", "lg_throttle",
          "mio_throttle", "not_selected", "dispatch_stall", "no_instruction")
_STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__warps_active.avg.per_cycle_active",
           "launch__grid_size", "launch__registers_per_thread") + tuple(_STALL.format(s) for s in STALLS)
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
_TO_BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def case(text: str) -> tuple[str, str]:
    """``"scheme:projection"`` checked against ``SCHEMES`` and ``SHAPES`` (an argparse type)."""
    scheme, _, proj = text.partition(":")
    if scheme not in SCHEMES or proj not in SHAPES:
        raise argparse.ArgumentTypeError(f"expected scheme:projection with a scheme of {sorted(SCHEMES)} and a "
                                         f"projection of {sorted(SHAPES)}, got {text!r}")
    return scheme, proj


def launch(scheme: str, proj: str, calls: int = 4) -> None:
    """``calls`` one-row ``gemv`` launches of ``proj`` with ``scheme`` weights (what ncu profiles), the
    codes in the layout a CUDA bind stores (``layers.quantize.bound_scheme``: int4 in blocks)."""
    from graphdsl.layers.quantize import bound_scheme
    from graphdsl.quant import parse_scheme
    from graphdsl.runtime.kernels.gemv import GemvWorkspace, gemv
    n, k = SHAPES[proj]
    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    if scheme in GGUF:
        return _launch_gguf(SCHEMES[scheme], proj, x, calls)
    w = torch.randn(n, k, device="cuda") * 0.02
    kw = {}
    if SCHEMES[scheme] is None:
        w = w.to(torch.bfloat16)
    else:
        sch = bound_scheme(parse_scheme(SCHEMES[scheme]))
        stored = sch.quantize(w, torch.bfloat16)
        w, kw = stored[0], dict(scheme=sch, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
    ws = GemvWorkspace()
    for _ in range(calls):
        gemv(x, w, silu_mul=proj.endswith("gate_up"), workspace=ws, **kw)
    torch.cuda.synchronize()


def _launch_gguf(qtype: str, proj: str, x: torch.Tensor, calls: int) -> None:
    """``calls`` one-row tensor-core ``gguf_gemv`` launches of ``proj`` in ``qtype`` blocks, the A
    operand of ``x`` made once before them (the model's norms and epilogues write it)."""
    from gguf_gemv import random_blocks
    from graphdsl.runtime.kernels.gemv import GemvWorkspace
    from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
    from graphdsl.runtime.kernels.gguf_mma import activation_planes
    from graphdsl.runtime.kernels.gguf_mma_q6k import q6k_activation_planes
    n, k = SHAPES[proj]
    data = random_blocks(qtype, n, k, seed=0)
    planes = q6k_activation_planes(x[0]) if qtype == "Q6_K" else activation_planes(x[0])
    silu = proj.endswith("gate_up") and qtype == "Q4_K"      # the SwiGLU epilogue is the Q4_K GEMV's
    ws = GemvWorkspace()
    for _ in range(calls):
        gguf_gemv(x, data, qtype, silu_mul=silu, workspace=ws, planes=planes, config=None)
    torch.cuda.synchronize()


def parse(text: str) -> dict[str, float]:
    """The metrics of the one profiled kernel in ``ncu --page raw --csv`` output: ``{metric: value}``,
    the time in µs, byte counts in bytes. Raises ``ValueError`` naming what is missing."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        raise ValueError("ncu printed no profiled kernel (no CSV rows): " + (text.strip().splitlines() or [""])[-1])
    names, units, values = rows[0], rows[1], rows[2]
    got = {}
    for name, unit, value in zip(names, units, values):
        if name in METRICS:
            v = float(value.replace(",", "")) if value.strip() not in ("", "n/a") else 0.0
            if name == "gpu__time_duration.sum":
                if unit not in _TO_US:
                    raise ValueError(f"ncu gave gpu__time_duration.sum in {unit!r}, expected one of {sorted(_TO_US)}")
                v *= _TO_US[unit]
            elif name == "dram__bytes_read.sum":
                if unit not in _TO_BYTES:
                    raise ValueError(f"ncu gave dram__bytes_read.sum in {unit!r}, expected one of {sorted(_TO_BYTES)}")
                v *= _TO_BYTES[unit]
            got[name] = v
    missing = [m for m in METRICS if m not in got]
    if missing:
        raise ValueError(f"ncu output lacks the metrics {missing}")
    return got


def row(label: str, m: dict[str, float]) -> str:
    """One markdown table row of the parsed metrics ``m``."""
    us = m["gpu__time_duration.sum"]
    stalls = ", ".join(f"{s} {m[_STALL.format(s)]:.2f}" for s in STALLS if m[_STALL.format(s)] >= 0.1)
    return (f"| {label} | {int(m['launch__grid_size'])} x {int(m['launch__registers_per_thread'])} regs | {us:.2f} | "
            f"{m['dram__bytes_read.sum'] / us / 1e3:.0f} ({m['dram__throughput.avg.pct_of_peak_sustained_elapsed']:.0f}%) | "
            f"{m['smsp__issue_active.avg.pct_of_peak_sustained_active']:.0f}% | "
            f"{m['smsp__warps_active.avg.per_cycle_active']:.2f} | {stalls} |")


def profile(ncu: str, scheme: str, proj: str) -> dict[str, float]:
    cmd = [ncu, "--clock-control", "none", "--kernel-name", "regex:" + KERNELS.get(scheme, "_gemv_kernel"),
           "--launch-skip", "3",
           "--launch-count", "1", "--page", "raw", "--csv", "--metrics", ",".join(METRICS),
           sys.executable, os.path.abspath(__file__), "--child", f"{scheme}:{proj}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"ncu failed on {scheme}:{proj} (exit {out.returncode}): "
                           + " | ".join((out.stdout + out.stderr).strip().splitlines()[-3:]))
    return parse(out.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=case, nargs="+",
                    default=[case(c) for c in ("int4:8b.down", "int4:8b.gate_up", "fp8:8b.down", "bf16:8b.down")],
                    help="scheme:projection pairs (default: %(default)s)")
    ap.add_argument("--ncu", default="/usr/local/cuda/bin/ncu", help="the ncu binary (default: %(default)s)")
    ap.add_argument("--child", type=case, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_gemv.py: needs a CUDA GPU (this machine has none)", file=sys.stderr)
        return 2
    if args.child:
        launch(*args.child)
        return 0
    ncu = shutil.which(args.ncu)
    if ncu is None:
        print(f"ncu_gemv.py: --ncu: no executable {args.ncu!r} (Nsight Compute's ncu; pass its path)", file=sys.stderr)
        return 2
    print(f"## One decode GEMV launch under ncu, one row — {torch.cuda.get_device_name()}\n")
    print("| case | grid x registers | µs | DRAM GB/s (of peak) | issue active | warps a scheduler | "
          "stalls, cycles an issued instruction |")
    print("|---|---|---:|---:|---:|---:|---|")
    for scheme, proj in args.cases:
        print(row(f"{scheme} {proj}", profile(ncu, scheme, proj)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
