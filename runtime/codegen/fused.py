"""Generated Triton kernels for ``fused`` groups (pointwise ops, optionally ending in a row reduction).

One template, specialised per group: the group's iteration space is viewed as ``rows x C`` (``C``
the last dim; the leading dims unravelled from the row index), every operand is addressed through
its own strides over that space (stride 0 where it broadcasts), so views such as the halves of a
packed gate/up projection are read in place. Adjacent dims that every operand walks contiguously
are merged on the host first, so a contiguous elementwise group runs as one flat 1-D loop.

* pointwise group: one program per ``BLOCK`` columns of a row, ``grid = rows * ceil(C / BLOCK)``;
* group ending in a row reduction: one program per row, ``BLOCK >= C`` (the row in registers),
  every value before the reduction is a vector over the row, the reduction's result a scalar
  (sum/mean/max) or a vector (rms_norm/softmax).

Every kernel waits for its predecessor (programmatic dependent launch, ``kernels/pdl.py``) after
computing its indices; inputs the caller names ``early`` (tensors no kernel of the step writes: a
norm's weight) are loaded before that wait, so their memory latency overlaps the previous kernel.

Kernel sources are kept (``FusedKernel.source``) for dumps and cached by their hash, in memory and
as files (Triton's JIT and interpreter both need a source file).
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.functional._rules import broadcast_shapes
from graphdsl.opdef import OpCategory, Spec, get_op

from ..device import triton_interprets
from ..kernels.pdl import pdl_launch
from .lowering import PRELUDE, ROW_REDUCTIONS, Operand, compute_type, lower_pointwise, tl_dtype

__all__ = ["launch_config", "FusedKernel", "prepare_fused", "run_fused", "kernel_source", "MAX_ROW", "kernel_cache_dir"]

MAX_ROW = 65536          # longest row a reduction kernel holds in registers
_POINTWISE_BLOCK = 1024
_EARLY_LOADS = True      # load the ``early`` inputs before the PDL wait (False: every load after it)


def launch_config(C: int, reduction: bool) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of ``C`` elements — the one heuristic every kernel here uses.

    Reductions hold the whole row (BLOCK = next power of two >= C) with more warps for longer
    rows; pointwise kernels take up to 1024 columns per program (8 elements per thread at 4 warps:
    16-byte accesses for 16-bit types).
    """
    block = 1 << max(0, math.ceil(math.log2(max(C, 1))))
    if reduction:
        if block > MAX_ROW:
            raise GraphDSLError(f"fused row reduction: row length {C} exceeds the supported maximum {MAX_ROW}")
        warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
        return block, warps
    block = min(block, _POINTWISE_BLOCK)
    return block, 4 if block >= 512 else 2 if block >= 128 else 1


# -- analysis ------------------------------------------------------------------------------------
def _literal(v, dtype: torch.dtype):
    v = float(v) if dtype.is_floating_point else int(v)
    return v


def _lit_text(v) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        if math.isnan(v):
            return 'float("nan")'
        return repr(v)
    return str(int(v))


@dataclass
class _Analysis:
    n_in: int
    specs: list                 # Spec per ref (inputs, then instructions)
    consts: dict                # ref -> python literal
    reduction: int | None       # instruction index of the row reduction
    shape: tuple                # iteration shape (concrete)
    data_inputs: list           # input refs read as data


def _analyse(program, in_specs: list[Spec]) -> _Analysis:
    n_in = len(in_specs)
    specs, consts = list(in_specs), {}
    data_inputs, reduction = [], None
    for k, (op, refs, attr_pairs) in enumerate(program):
        opdef, attrs = get_op(op), dict(attr_pairs)
        s = opdef.infer([specs[r] for r in refs], attrs)[0]
        specs.append(s)
        ref = n_in + k
        if op == "scalar":           # a copied-in constant: its input only gave it a dtype
            consts[ref] = _literal(attrs["value"], s.dtype)
            continue
        if all(r in consts for r in refs):
            vals = [torch.tensor(consts[r], dtype=specs[r].dtype) for r in refs]
            consts[ref] = _literal(opdef.run(vals, attrs)[0].item(), s.dtype)
            continue
        if opdef.category is OpCategory.REDUCTION:
            if k != len(program) - 1 or op not in ROW_REDUCTIONS:
                raise GraphDSLError(f"fused: reduction '{op}' must be the group's last op and one of {ROW_REDUCTIONS}")
            reduction = k
        for r in refs:
            if r < n_in and r not in data_inputs:
                data_inputs.append(r)
    if reduction is not None:
        shape = tuple(specs[program[reduction][1][0]].shape)
    else:
        shapes = [tuple(specs[r].shape) for r in range(len(specs)) if r not in consts and
                  (r >= n_in or r in data_inputs)]
        shape = tuple(broadcast_shapes(shapes, "fused")) if shapes else ()
    return _Analysis(n_in, specs, consts, reduction, shape, sorted(data_inputs))


# -- source generation ------------------------------------------------------------------------------
def kernel_source(program, outputs, specs: list[Spec], consts: dict, reduction: int | None,
                  data_inputs: list[int], n_in: int, rank: int, reduced_outputs: set[int],
                  early: frozenset = frozenset()) -> str:
    """The Triton source of one fused kernel over an iteration space of ``rank`` dims. Data inputs
    in ``early`` are loaded before the PDL wait (no kernel of the step may write them)."""
    L = rank - 1
    ins = [f"in{r}_ptr" for r in data_inputs]
    outs = [f"out{j}_ptr" for j in range(len(outputs))]
    sizes = [f"size{d}" for d in range(L)]
    args = []
    for r in data_inputs:
        # dtype and rank only: a source (so its compiled kernel) must not depend on the call's sizes
        args.append(f"    in{r}_ptr,  # input {r}: {_dt(specs[r])}, rank {len(specs[r].shape)}")
    for j, r in enumerate(outputs):
        args.append(f"    out{j}_ptr,  # output {j} (value %{r}): {_dt(specs[r])}")
    for s in sizes:
        args.append(f"    {s},  # leading iteration size")
    args.append("    C,  # row length: size of the last iteration dim")
    args.append("    NB,  # column blocks per row (1 for a reduction)")
    for r in data_inputs:
        args.append("    " + ", ".join(f"in{r}_s{d}" for d in range(rank)) + f",  # input {r} strides (0: broadcast)")
    for j in range(len(outputs)):
        args.append("    " + ", ".join(f"out{j}_s{d}" for d in range(rank)) + f",  # output {j} strides")
    args.append("    BLOCK: tl.constexpr,  # columns per program")
    args.append("    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)")
    math_lines = []
    for k, (op, refs, attr_pairs) in enumerate(program):
        a = ", ".join(f"%{r}" for r in refs)
        at = ", ".join(f"{kk}={vv}" for kk, vv in attr_pairs)
        math_lines.append(f"    %{n_in + k} = {op}({a}{', ' + at if at else ''})")
    doc = ("    \"\"\"Fused group over rows x C" + (" ending in a row reduction" if reduction is not None else "")
           + ":\n\n" + "\n".join(math_lines) + "\n\n    returns " + ", ".join(f"%{r}" for r in outputs) + "\n    \"\"\"")
    body = []
    if reduction is None:
        body += ["    pid = tl.program_id(0).to(tl.int64)", "    row = pid // NB",
                 "    cols = (pid % NB) * BLOCK + tl.arange(0, BLOCK)"]
    else:
        body += ["    row = tl.program_id(0).to(tl.int64)", "    cols = tl.arange(0, BLOCK)"]
    body.append("    mask = cols < C")
    body.append("    rem = row")
    for d in reversed(range(L)):
        if d == 0:
            body.append("    i0 = rem")
        else:
            body += [f"    i{d} = rem % size{d}", f"    rem = rem // size{d}"]

    def offset(prefix: str, with_cols: bool) -> str:
        terms = [f"i{d} * {prefix}_s{d}" for d in range(L)]
        if with_cols:
            terms.append(f"cols * {prefix}_s{L}")
        return " + ".join(terms) if terms else "0"

    vals: dict[int, Operand] = {}
    loads = {r: f"    x{r} = tl.load(in{r}_ptr + ({offset(f'in{r}', True)}), mask=mask, other=0)" for r in data_inputs}
    body += [loads[r] for r in data_inputs if r in early]          # before the wait: nothing writes them
    body.append("    pdl_wait(USE_PDL)")
    body += [loads[r] for r in data_inputs if r not in early]
    for r in data_inputs:
        vals[r] = Operand(f"x{r}", specs[r].dtype)
    for r, v in consts.items():
        vals[r] = Operand(_lit_text(v), specs[r].dtype, literal=v)
    for k, (op, refs, attr_pairs) in enumerate(program):
        ref = n_in + k
        if ref in consts:
            continue
        out = specs[ref].dtype
        args_ = [vals[r] for r in refs]
        attrs = dict(attr_pairs)
        if k == reduction:
            body += _reduction_lines(op, ref, args_, out, attrs)
        else:
            body.append(f"    v{ref} = ({lower_pointwise(op, args_, out, attrs)}).to({tl_dtype(out)})")
        vals[ref] = Operand(f"v{ref}", out)
    for j, r in enumerate(outputs):
        v = vals[r]
        text = f"(tl.zeros([BLOCK], {tl_dtype(specs[r].dtype)}) + {v.text})" if v.is_literal else v.text
        if r in reduced_outputs:
            body.append(f"    tl.store(out{j}_ptr + ({offset(f'out{j}', False)}), {text})")
        else:
            body.append(f"    tl.store(out{j}_ptr + ({offset(f'out{j}', True)}), {text}, mask=mask)")
    return ("import triton\nimport triton.language as tl\n\nfrom graphdsl.runtime.kernels.pdl import pdl_wait\n\n"
            + PRELUDE + "\n\n@triton.jit\ndef fused_kernel(\n"
            + "\n".join(args) + "\n):\n" + doc + "\n" + "\n".join(body) + "\n")


def _dt(s: Spec) -> str:
    return str(s.dtype).removeprefix("torch.")


def _reduction_lines(op: str, ref: int, args: list[Operand], out: torch.dtype, attrs: dict) -> list[str]:
    x = args[0]
    o, ct = tl_dtype(out), compute_type(out)
    v = f"v{ref}"
    if op == "rms_norm":
        w = args[1]
        return [f"    _xf = {x.to('tl.float32')}",
                "    _xm = tl.where(mask, _xf, 0.0)",
                f"    _r = tl.rsqrt(tl.sum(_xm * _xm, axis=0) / C + {_lit_text(float(attrs['eps']))})",
                f"    _y = (_xf * _r).to({tl_dtype(x.dtype)})",
                f"    {v} = ({w.to(ct)} * _y.to({ct})).to({o})"]
    if op == "softmax":
        return [f"    _xf = tl.where(mask, {x.to('tl.float32')}, float(\"-inf\"))",
                "    _e = tl.where(mask, tl.exp(_xf - tl.max(_xf, axis=0)), 0.0)",
                f"    {v} = (_e / tl.sum(_e, axis=0)).to({o})"]
    if op == "sum":
        return [f"    {v} = tl.sum(tl.where(mask, {x.to(ct)}, 0), axis=0).to({o})"]
    if op == "mean":
        return [f"    {v} = (tl.sum(tl.where(mask, {x.to(ct)}, 0.0), axis=0) / C).to({o})"]
    if op == "max":
        return [f"    {v} = tl.max(tl.where(mask, {x.to(ct)}, float(\"-inf\")), axis=0).to({o})"]
    raise GraphDSLError(f"fused: no lowering for row reduction '{op}'; supported: {ROW_REDUCTIONS}")


# -- compile cache ---------------------------------------------------------------------------------
_KERNELS: dict[str, object] = {}


def kernel_cache_dir() -> Path:
    """Where generated kernel sources are written and imported from: ``$GRAPHDSL_KERNEL_CACHE``, else
    ``graphdsl-kernels-<uid>`` in the temp directory."""
    return Path(os.environ.get("GRAPHDSL_KERNEL_CACHE") or Path(tempfile.gettempdir()) / f"graphdsl-kernels-{os.getuid()}")


def _cache_dir() -> Path:
    d = kernel_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


def compile_source(source: str):
    """The ``fused_kernel`` of ``source``, compiled once per source hash (and interpreter mode)."""
    interp = triton_interprets()
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    fn = _KERNELS.get((key, interp))
    if fn is None:
        path = _cache_dir() / f"fused_{key}.py"
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"graphdsl_fused_{key}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fn = _KERNELS[(key, interp)] = mod.fused_kernel
    return fn


# -- host side -----------------------------------------------------------------------------------------
def _aligned_strides(t: torch.Tensor, shape: tuple, reduced: bool = False) -> list[int]:
    """Strides of ``t`` over the iteration ``shape`` (right-aligned, 0 where it broadcasts)."""
    R = len(shape)
    if reduced:          # a per-row result: [lead...] or [lead..., 1]; the row dim has stride 0
        lead = R - 1
        st = list(t.stride())[:lead] if t.dim() >= lead else []
        sz = list(t.shape)[:lead]
        return [s if n != 1 else 0 for s, n in zip(st, sz)] + [0]
    out = [0] * R
    off = R - t.dim()
    for d in range(t.dim()):
        if t.shape[d] != 1:
            out[off + d] = t.stride(d)
    return out


def _collapse(shape: list[int], strides: list[list[int]], keep_last: bool):
    R = len(shape)
    idx = [d for d in range(R) if shape[d] != 1 or (keep_last and d == R - 1)] or [R - 1]
    shp = [shape[d] for d in idx]
    sts = [[s[d] for d in idx] for s in strides]
    out_shape, out_st = [shp[0]], [[s[0]] for s in sts]
    for j in range(1, len(shp)):
        last = j == len(shp) - 1
        merge = not (keep_last and last) and all(s[j - 1] == s[j] * shp[j] for s in sts)
        if merge:
            out_shape[-1] *= shp[j]
            for o, s in zip(out_st, sts):
                o[-1] = s[j]
        else:
            out_shape.append(shp[j])
            for o, s in zip(out_st, sts):
                o.append(s[j])
    return out_shape, out_st


@dataclass
class FusedKernel:
    source: str
    fn: object
    grid: tuple
    args: list
    block: int
    num_warps: int
    pdl: dict

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        if self.grid[0] == 0:
            return
        self.fn[self.grid](*inputs, *outputs, *self.args, BLOCK=self.block, num_warps=self.num_warps, **self.pdl)


def prepare_fused(program, outputs, inputs: list[torch.Tensor], dsts: list[torch.Tensor],
                  early=()) -> tuple[FusedKernel, list[int]]:
    """Generate (or fetch) the kernel for these concrete operands; returns it and the data-input refs.
    ``early``: indices of ``inputs`` that no kernel of the step writes (read before the PDL wait)."""
    an = _analyse(program, [Spec(tuple(x.shape), x.dtype) for x in inputs])
    shape = list(an.shape) or [1]
    is_red = an.reduction is not None
    red_ref = an.n_in + an.reduction if is_red else None
    reduced = set()
    if is_red and get_op(program[an.reduction][0]).name in ("sum", "mean", "max"):
        reduced.add(red_ref)
    strides = [_aligned_strides(inputs[r], tuple(shape)) for r in an.data_inputs]
    strides += [_aligned_strides(d, tuple(shape), reduced=r in reduced) for d, r in zip(dsts, outputs)]
    cshape, cstrides = _collapse(shape, strides, keep_last=is_red)
    rank = len(cshape)
    C = cshape[-1]
    rows = math.prod(cshape[:-1])
    block, warps = launch_config(C, is_red)
    nb = 1 if is_red else -(-C // block)
    early = frozenset(early) & set(an.data_inputs) if _EARLY_LOADS else frozenset()
    src = kernel_source(program, outputs, an.specs, an.consts, an.reduction, an.data_inputs, an.n_in, rank, reduced,
                        early)
    fn = compile_source(src)
    args = list(cshape[:-1]) + [C, nb] + [s for st in cstrides for s in st]
    grid = (rows * nb if C > 0 else 0,)
    device = (dsts or inputs)[0].device
    return FusedKernel(src, fn, grid, args, block, warps, pdl_launch(device)), an.data_inputs


def run_fused(program, outputs, inputs: list[torch.Tensor], dsts: list[torch.Tensor]) -> FusedKernel:
    """Prepare and launch in one go (tests, benchmarks, the thin wrappers)."""
    k, data = prepare_fused(program, outputs, inputs, dsts)
    k([inputs[r] for r in data], dsts)
    return k
