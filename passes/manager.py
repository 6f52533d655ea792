"""The pass manager: named passes in one declared order, each timed and linted, with dumps.

::

    pm = PassManager(disable=["matmul_epilogue"])          # or GRAPHDSL_DISABLE_PASSES=a,b
    report = pm.run(net, dump_dir="out/")                  # edits net in place
    print(report)                                          # pass, ms, nodes before/after, what fused

The pipeline (:data:`PIPELINE`) is a table: a pass is either a named table of rewrite rules,
applied by the one driver in :mod:`graphdsl.passes.rewriter`, or a function over a
:class:`~graphdsl.passes.graph_edit.GraphEditor`. A disabled rule pass still *matches* (without
rewriting), so the fusion report can say "this would have fused, but the pass is disabled".
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from graphdsl.env import env_flag
from graphdsl.errors import GraphDSLError
from graphdsl.network import Network, Node

from .canonicalize import CANONICALIZE_RULES
from .constant_fold import declared_parameters, parameter_only_nodes
from .cse import common_subexpression_elimination
from .dce import dead_code_elimination
from .generic_fusion import default_can_fuse, fuse_groups
from .graph_edit import GraphEditor
from .horizontal import merge_projections
from .llm_fusions import (ADD_RMS_NORM_RULES, LORA_EPILOGUE_RULES, MATMUL_EPILOGUE_RULES, MATMUL_SILU_MUL_RULES,
                          ROPE_CACHE_ATTENTION_RULES, ROPE_CACHE_RULES, SWIGLU_RULES)
from .rewriter import NearMiss, Rule, apply_rules

__all__ = ["PassSpec", "PassContext", "PassRecord", "BuildReport", "PassManager", "PIPELINE", "pass_names",
           "disabled_from_env"]


@dataclass
class PassContext:
    """What passes share: the backend's fusability test, nodes to leave for constant folding,
    and the near misses collected for the fusion report."""

    can_fuse: Callable[[Node], str | None] = default_can_fuse
    parameter_only: set = field(default_factory=set)
    near_misses: list[NearMiss] = field(default_factory=list)


@dataclass
class PassSpec:
    """A named pass: ``rules`` (a rule table) or ``fn(editor, ctx) -> str`` (a whole pass)."""

    name: str
    doc: str
    rules: list[Rule] | None = None
    fn: Callable[[GraphEditor, PassContext], str] | None = None
    report_misses: bool = True      # near misses belong in "why didn't this fuse?"


@dataclass
class PassRecord:
    name: str
    enabled: bool
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    detail: str = ""


@dataclass
class BuildReport:
    """Per-pass timing, node counts and what fused; near misses for ``engine.fusion_report()``."""

    records: list[PassRecord] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    applied: list[tuple[str, str, str]] = field(default_factory=list)   # (rule, anchor node, new nodes)
    disabled: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def __str__(self) -> str:
        w = max([18] + [len(r.name) for r in self.records])
        lines = [f"{'#':>2}  {'pass':<{w}} {'ms':>9}  {'nodes':>13}  what happened"]
        for i, r in enumerate(self.records, 1):
            nodes = f"{r.nodes_before:>5} -> {r.nodes_after:<5}" if r.enabled else f"{'':>13}"
            lines.append(f"{i:>2}  {r.name:<{w}} {r.seconds * 1e3:>9.1f}  {nodes}  "
                         + (r.detail if r.enabled else "disabled" + (f" ({r.detail})" if r.detail else "")))
        lines.append(f"    {'total':<{w}} {self.seconds * 1e3:>9.1f}")
        return "\n".join(lines)


# -- the whole passes --------------------------------------------------------------------------
def _dce(ed: GraphEditor, ctx: PassContext) -> str:
    ed.commit()
    n = dead_code_elimination(ed.net)
    _reload(ed)
    return f"removed {n} dead nodes"


def _cse(ed: GraphEditor, ctx: PassContext) -> str:
    return f"merged {common_subexpression_elimination(ed)} duplicate nodes"


def _constant_fold(ed: GraphEditor, ctx: PassContext) -> str:
    ed.commit()
    nodes = parameter_only_nodes(ed.net, declared_parameters(ed.net))
    ctx.parameter_only = set(nodes)
    return f"{len(nodes)} parameter-only nodes, folded when weights are bound"


def _merge_projections(ed: GraphEditor, ctx: PassContext) -> str:
    merged = merge_projections(ed)
    return ", ".join(f"{n} matmuls at {name}" for name, n in merged) or "no shared-input projections"


def _generic(ed: GraphEditor, ctx: PassContext) -> str:
    made, misses = fuse_groups(ed, ctx.can_fuse, ctx.parameter_only)
    ctx.near_misses.extend(misses)
    multi = sum(1 for n in made if len(n.attrs["program"]) > 1)
    absorbed = sum(len(n.attrs["absorbed"]) for n in made)
    return f"{len(made)} fused kernels ({multi} of several ops) absorbing {absorbed} ops"


def _reload(ed: GraphEditor) -> None:
    fresh = GraphEditor(ed.net)
    ed.g, ed.pos, ed._names = fresh.g, fresh.pos, fresh._names


PIPELINE: list[PassSpec] = [
    PassSpec("dce", "drop nodes whose results nothing reads", fn=_dce),
    PassSpec("cse", "merge nodes computing the same op on the same inputs", fn=_cse),
    PassSpec("canonicalize", "transposes into matmul flags; no-op casts, reshapes, permutes out",
             rules=CANONICALIZE_RULES, report_misses=False),
    PassSpec("merge_projections", "matmuls of one input by several weights -> one matmul by the concatenated "
             "weights + split (q/k/v, gate/up)", fn=_merge_projections),
    PassSpec("constant_fold", "mark parameter-only subgraphs; the engine folds them at set_weights",
             fn=_constant_fold),
    PassSpec("rope_cache", "rope(q, k) + KV-cache write -> rope_cache", rules=ROPE_CACHE_RULES),
    PassSpec("rope_cache_attention", "decode: rope_cache + paged_attention -> rope_cache_attention",
             rules=ROPE_CACHE_ATTENTION_RULES),
    PassSpec("swiglu", "silu(gate) * up (packed or two projections) -> silu_mul", rules=SWIGLU_RULES),
    PassSpec("matmul_silu_mul", "silu_mul(matmul) -> matmul_silu_mul (SwiGLU in the GEMV epilogue)",
             rules=MATMUL_SILU_MUL_RULES),
    PassSpec("add_rms_norm", "residual add + rms_norm -> add_rms_norm (normed, residual)",
             rules=ADD_RMS_NORM_RULES),
    PassSpec("matmul_epilogue", "matmul + bias / residual -> matmul_add (GEMM epilogue); lora_apply(matmul) -> "
             "matmul_lora / matmul_silu_mul_lora / matmul_add_lora (the LoRA term in the projection)",
             rules=MATMUL_EPILOGUE_RULES + LORA_EPILOGUE_RULES),
    PassSpec("generic_fusion", "connected pointwise ops (+ one row reduction) -> one fused kernel", fn=_generic),
]


def pass_names() -> list[str]:
    return [p.name for p in PIPELINE]


def disabled_from_env() -> list[str]:
    raw = os.environ.get("GRAPHDSL_DISABLE_PASSES", "")
    return [x.strip() for x in raw.split(",") if x.strip()]


def _check_names(names: Iterable[str], what: str) -> list[str]:
    names = list(names)
    valid = pass_names()
    bad = [n for n in names if n not in valid]
    if bad:
        raise GraphDSLError(f"{what}: unknown pass name(s) {bad}; valid passes, in order: {valid}")
    return names


class PassManager:
    """Run the pipeline's passes in declared order.

    Args:
        passes: names to run (default: all); the declared order is kept whatever order is given.
        disable: names to skip (added to ``$GRAPHDSL_DISABLE_PASSES``).
        lint: run ``net.lint()`` after every pass (default: on under pytest or with
            ``GRAPHDSL_LINT=1``).
        can_fuse: the backend's test of which nodes its fused kernels can compute.
    """

    def __init__(self, passes: Iterable[str] | None = None, disable: Iterable[str] | None = None,
                 lint: bool | None = None, can_fuse: Callable[[Node], str | None] | None = None):
        enabled = set(_check_names(passes, "passes=") if passes is not None else pass_names())
        off = set(_check_names(disable or (), "disable=")) | set(_check_names(disabled_from_env(),
                                                                              "GRAPHDSL_DISABLE_PASSES"))
        self.enabled = [p.name for p in PIPELINE if p.name in enabled and p.name not in off]
        if lint is None:
            lint = env_flag("GRAPHDSL_LINT", "PYTEST_CURRENT_TEST" in os.environ)
        self.lint = lint
        self.can_fuse = can_fuse or default_can_fuse

    def run(self, net: Network, *, dump_dir=None) -> BuildReport:
        """Rewrite ``net`` in place; return the build report. ``dump_dir`` gets ``NN-pass.txt/.dot``."""
        report = BuildReport(disabled=[p.name for p in PIPELINE if p.name not in self.enabled])
        ctx = PassContext(can_fuse=self.can_fuse)
        d = Path(dump_dir) if dump_dir else None
        ed = GraphEditor(net)
        for i, spec in enumerate(PIPELINE, 1):
            on = spec.name in self.enabled
            rec = PassRecord(spec.name, on, nodes_before=len(ed.pos))
            t0 = time.perf_counter()
            if spec.rules is not None:
                res = apply_rules(ed, spec.rules, pass_name=spec.name, dry_run=not on,
                                  dry_reason=f"would fuse, but pass '{spec.name}' is disabled")
                if spec.report_misses:
                    ctx.near_misses.extend(res.near_misses)
                    report.applied.extend(res.applied)
                counts = res.counts()
                rec.detail = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "no match"
                if not on:
                    n_would = sum(1 for m in res.near_misses if m.reason.startswith("would fuse"))
                    rec.detail = f"{n_would} matches not applied"
            elif on:
                rec.detail = spec.fn(ed, ctx)
            ed.commit()
            rec.seconds = time.perf_counter() - t0
            rec.nodes_after = len(ed.pos)
            report.records.append(rec)
            if on and self.lint:
                try:
                    net.lint()
                except GraphDSLError as e:
                    raise GraphDSLError(f"after pass '{spec.name}': {e}") from None
            if d is not None and on:
                d.mkdir(parents=True, exist_ok=True)
                net.dump(d / f"{i:02d}-{spec.name}.txt")
                net.dump(d / f"{i:02d}-{spec.name}.dot")
        report.near_misses = ctx.near_misses
        if d is not None:
            (d / "build_report.txt").write_text(str(report) + "\n")
        return report
