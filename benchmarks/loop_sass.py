"""SASS instructions in the decode GEMV's K loop, compiled for a GPU architecture on any machine.

A one-row GEMV loop near the memory roofline is bound by how many instructions it issues per
weight byte, so this is the number to watch while changing it — and it needs no GPU: the script
captures the launch :func:`graphdsl.runtime.kernels.gemv.gemv` would make for a projection of the
Llama-3-8B shape (its arguments, specialisations and constexprs, with the SM count of an H100/H200),
compiles that kernel with Triton for ``--arch`` (``ptxas`` and ``cuobjdump`` ship with Triton's
NVIDIA backend), and counts the instructions between the loop's first instruction and its
backward branch (the longest such loop in the kernel). Prints a table: instructions per K step
and thread, weight bytes a thread reads per step, their ratio, the barriers (``BAR``: a layout
conversion through shared memory, which makes every warp of the program wait), the top opcodes.

    python benchmarks/loop_sass.py [--arch 90] [--launch int4-qkv fp8-gate_up ...] [--no-x-wide] [--no-quads]
    python benchmarks/loop_sass.py --gguf Q4_K:14336:4096:32:planes Q6_K:4096:4096:32 [--float32-planes]
    python benchmarks/loop_sass.py --gguf Q8_0:14336:4096:8:mma Q8_0:14336:4096:8:planes

``--gguf TYPE:N:K:ROWS ...`` counts instead the K loop of ``gguf_linear.gguf_gemv``'s launch for
``ROWS`` bf16 activation rows of a block-major GGUF weight (2-32 rows of Q4_K, Q5_K or Q8_0 and 2-16
of Q6_K: the several-row tensor-core loop, ``gguf_mma_rows``; more: the plane-a-dot loop; ``TYPE:N:K:ROWS:mma``
that loop for any type it takes, ``TYPE:N:K:ROWS:planes`` the plane-a-dot loop at any row count),
per super-block step: instructions, weights a thread, their ratio, the ``HGMMA`` and the
``WARPGROUP.ARRIVE`` / ``DEPBAR`` pairs around them (one a ``HGMMA``: each waited for), ``BAR.SYNC``; ``--float32-planes`` with the float32 plane decode instead of
the packed PTX (``gguf_linear._FAST_PLANES`` off).

Timing still needs the device (``decode_ab.py``): ``docs/quantization-log.md`` "Fewer instructions in
the one-row loops" lists changes that cut instructions and ones that did not make the model faster.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

import torch

# (weight scheme, N, K, SwiGLU, packed activations): the Llama-3-8B projections' one-row launches (int4 codes in
# blocks, as a CUDA bind stores them: layers.quantize.store_codes_in_blocks)
LAUNCHES = {
    "int4-qkv": ("int4-g128-kb", 6144, 4096, False, False),
    "int4-o": ("int4-g128-kb", 4096, 4096, False, False),
    "int4-gate_up": ("int4-g128-kb", 28672, 4096, True, True),
    "int4-down": ("int4-g128-kb", 4096, 14336, False, False),
    "fp8-qkv": ("fp8-channel", 6144, 4096, False, False),
    "fp8-gate_up": ("fp8-channel", 28672, 4096, True, False),
    "fp8a8-qkv": ("fp8-channel-dyn", 6144, 4096, False, False),
    "fp8a8-gate_up": ("fp8-channel-dyn", 28672, 4096, True, False),
    "fp8a8-down": ("fp8-channel-dyn", 4096, 14336, False, False),
    "bf16-qkv": (None, 6144, 4096, False, False),
}
_SMS = 132


def capture_launch(name: str, x_wide: bool = True, quads: bool = True):
    """``(kernel, grid, args, kwargs)`` of the GEMV launch ``name`` (a key of ``LAUNCHES``), made
    by ``gemv`` on CPU tensors with the kernel replaced by a recorder (nothing runs). ``x_wide`` /
    ``quads``: the launch with ``gemv``'s ``_X_WIDE`` / ``_QUADS`` set so."""
    import graphdsl.runtime.kernels.gemv as G
    from graphdsl.quant import parse_scheme
    from graphdsl.runtime.kernels.int4_acts import pack_int4_activations_reference
    scheme_name, n, k, silu, xpack = LAUNCHES[name]
    scheme = parse_scheme(scheme_name) if scheme_name else None
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    if scheme is None:
        w, kw = torch.zeros(n, k, dtype=torch.bfloat16), {}
    else:
        stored = scheme.quantize(torch.zeros(n, k), torch.bfloat16)
        w, kw = stored[0], dict(scheme=scheme, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
        if xpack:
            kw["xpack"] = pack_int4_activations_reference(x[0], scheme.group_size)
    seen = []

    class _Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, args, kwargs))

    saved = G._gemv_kernel, G._num_sms, G._X_WIDE, G._QUADS
    G._gemv_kernel, G._num_sms, G._X_WIDE, G._QUADS = _Recorder(), lambda device: _SMS, x_wide, quads
    try:
        G.gemv(x, w, silu_mul=silu, **kw)
    finally:
        G._gemv_kernel, G._num_sms, G._X_WIDE, G._QUADS = saved
    (grid, args, kwargs), = seen
    return G._gemv_kernel, grid, args, kwargs


_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int64: "i64",
           torch.float8_e4m3fn: "fp8e4nv"}


def compile_launch(kernel, args, kwargs, arch: int):
    """Compile ``kernel`` for ``sm_{arch}`` as Triton would specialise this launch: tensors as
    pointers (16-byte aligned ones marked so), ints equal to 1 as constants, multiples of 16 marked."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    options = {o: kwargs.pop(o) for o in ("num_warps", "num_stages", "launch_pdl") if o in kwargs}
    names = [p.name for p in kernel.params]
    values = dict(zip(names, args), **kwargs)
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values.get(p.name, p.default)
        if p.is_constexpr:
            sig[p.name], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool) or v is None:
            sig[p.name], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, int):
            if v == 1:
                sig[p.name], constexprs[(i,)] = "constexpr", 1
            else:
                sig[p.name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
                if v % 16 == 0 and v != 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"loop_sass: argument {p.name} of type {type(v).__name__} has no Triton signature")
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _cuobjdump() -> str:
    import triton
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    if not found:
        raise FileNotFoundError("loop_sass: Triton's NVIDIA backend has no cuobjdump next to its ptxas")
    return found[0]


def loop_instructions(cubin: bytes) -> tuple[int, collections.Counter]:
    """``(count, opcodes)`` of the longest loop in the cubin's SASS: the instructions from a backward
    branch's target to the branch."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    best: list[str] = []
    for addr, ins in lines:
        m = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            body = [i for a, i in lines if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in best)
    return len(best), ops


def _step_bytes(name: str, kwargs: dict) -> int:
    """Weight bytes a thread reads per K step of the launch."""
    scheme_name = LAUNCHES[name][0]
    bits = 16 if scheme_name is None else 4 if scheme_name.startswith("int4") else 8
    threads = 32 * kwargs["num_warps"]
    return kwargs["BLOCK_N"] * kwargs["BLOCK_K"] * bits // 8 // threads


def capture_gguf(qtype: str, n: int, k: int, rows: int, how: str = ""):
    """``(kernel, grid, args, kwargs)`` of ``gguf_gemv``'s launch for ``rows`` bf16 rows of a block-major
    ``qtype [n, k]`` weight — the plane-a-dot GEMV, or for the rows ``gguf_linear.mma_eligible`` takes
    (2-32 of Q4_K, Q5_K, Q8_0; 2-16 of Q6_K) the several-row tensor-core GEMV
    (:mod:`~graphdsl.runtime.kernels.gguf_mma_rows`; its activation launch left out);
    ``how`` "mma": that GEMV at its default launch for any type it takes, "planes": the plane-a-dot
    launch ``_pick_config`` gives — recorded from CPU tensors (nothing runs; the kernels are restored)."""
    import graphdsl.runtime.kernels.gguf_linear as GL
    import graphdsl.runtime.kernels.gguf_mma_rows as GR
    from graphdsl.runtime.kernels.gguf_tiles import KERNEL_QTYPES
    per, nb = KERNEL_QTYPES[qtype]
    seen = []

    class _Recorder:
        def __init__(self, kernel, keep: bool):
            self.kernel, self.keep = kernel, keep

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.keep and seen.append((self.kernel, grid, args, kwargs))

    saved = GL._gguf_gemv_kernel, GL._num_sms, GR._rows_kernel, GR._rows_planes_kernel
    GL._gguf_gemv_kernel, GL._num_sms = _Recorder(saved[0], True), lambda device: _SMS
    GR._rows_kernel, GR._rows_planes_kernel = _Recorder(saved[2], True), _Recorder(saved[3], False)
    try:
        config = ({"MMA": True, **GR.pick_rows_config(n, k, _SMS, rows, qtype)} if how == "mma" else
                  GL._pick_config(rows, n, k, qtype, torch.device("cpu")) if how == "planes" else None)
        GL.gguf_gemv(torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(k // per, n, nb, dtype=torch.uint8), qtype,
                     config=config)
    finally:
        GL._gguf_gemv_kernel, GL._num_sms, GR._rows_kernel, GR._rows_planes_kernel = saved
    (kernel, grid, args, kwargs), = seen
    return kernel, grid, args, kwargs


def gguf_main(specs: list[str], arch: int, float32_planes: bool) -> int:
    """``--gguf``: the table of the several-row GGUF GEMV loops (module docstring)."""
    import graphdsl.runtime.kernels.gguf_linear as GL
    print(f"## GGUF GEMV K loops of several rows, sm_{arch}, bf16, block-major blocks"
          f"{', float32 plane decode' if float32_planes else ''}\n")
    print("| launch | BLOCK_N x rows, split | instructions a step | weights a thread | per weight | HGMMA "
          "| WARPGROUP arrive/wait pairs | BAR.SYNC | top opcodes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    keep = GL._FAST_PLANES
    GL._FAST_PLANES = not float32_planes
    try:
        for spec in specs:
            qtype, n, k, rows, *how = spec.split(":")
            kernel, grid, a, kw = capture_gguf(qtype, int(n), int(k), int(rows), "".join(how))
            count, ops = loop_instructions(compile_launch(kernel, a, dict(kw), arch).asm["cubin"])
            values = kw.get("SB", 1) * kw.get("VALUES", 256)           # a step: SB blocks, or one super-block
            weights = kw["BLOCK_N"] * values // (32 * kw["num_warps"])
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(5))
            print(f"| {spec} | {kw['BLOCK_N']} x {kw.get('BLOCK_M', kw.get('R'))}, {grid[1]} | {count} | {weights} | "
                  f"{count / weights:.2f} | {ops['HGMMA']} | {ops['WARPGROUP'] // 2} | {ops['BAR']} | {top} |",
                  flush=True)
    finally:
        GL._FAST_PLANES = keep
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    ap.add_argument("--launch", nargs="+", default=[n for n in LAUNCHES if not n.startswith("bf16")],
                    choices=sorted(LAUNCHES))
    ap.add_argument("--no-x-wide", action="store_true", help="the activations read 16 bits at a time")
    ap.add_argument("--no-quads", action="store_true",
                    help="int4: the scales and activations loaded as [BLOCK_N, G] / [G, C], not in the quads' layout")
    ap.add_argument("--gguf", nargs="+", metavar="TYPE:N:K:ROWS[:mma|:planes]",
                    help="count gguf_gemv's several-row loops instead (module docstring); ':mma': the tensor-core "
                         "rows kernel at its default launch, for any type it takes; ':planes': the plane-a-dot loop")
    ap.add_argument("--float32-planes", action="store_true", help="--gguf: the float32 plane decode")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("loop_sass.py compiles the kernels for a GPU: unset TRITON_INTERPRET (the interpreter runs them "
              "as Python instead)", file=sys.stderr)
        return 2
    if args.gguf:
        return gguf_main(args.gguf, args.arch, args.float32_planes)
    print(f"## decode GEMV K loops, sm_{args.arch}, one row, Llama-3-8B projections\n")
    print("| launch | BLOCK_N x BLOCK_K, split | instructions a step | weight bytes a thread | per byte | barriers "
          "| top opcodes |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name in args.launch:
        kernel, grid, a, kw = capture_launch(name, x_wide=not args.no_x_wide, quads=not args.no_quads)
        shape = f"{kw['BLOCK_N']} x {kw['BLOCK_K']}, {grid[1]}"
        nbytes = _step_bytes(name, kw)
        count, ops = loop_instructions(compile_launch(kernel, a, dict(kw), args.arch).asm["cubin"])
        top = ", ".join(f"{o} {c}" for o, c in ops.most_common(5))
        print(f"| {name} | {shape} | {count} | {nbytes} | {count / nbytes:.2f} | {ops['BAR']} | {top} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
