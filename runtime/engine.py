"""The built engine: an optimised network, a backend, and one memory plan per shape signature.

``engine.forward(inputs, outputs=None, runtime_params=None)`` validates every tensor it is given
(names, shapes with consistent Dims, dtypes, devices — errors name the tensor, the expected and
the actual value), specialises on the call's shapes (cached per signature), then runs the backend
over one arena and writes the marked outputs into the given buffers, or into new ones it returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from graphdsl.dim import DimExpr, bind_shapes, evaluate, shape_str
from graphdsl.dtypes import dtype_str
from graphdsl.errors import BindError, GraphDSLError
from graphdsl.network import Network
from graphdsl.opdef import OpCategory, RuntimeParam, Spec
from graphdsl.passes.fused_ops import FUSED_OPS
from graphdsl.passes.memory_plan import MemoryPlan, plan_memory

from .device import on_device
from .precompile import dry_pass_running, run_watched, watching
from .taps import TapSet, resolve_taps, taps_from_env

__all__ = ["Engine", "ShapePlan"]


@dataclass
class ShapePlan:
    """Everything specialised for one shape signature."""

    binding: dict[str, int]
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    attrs: dict                       # node -> attributes with Dims and runtime params resolved
    memory: MemoryPlan
    workspaces: dict = field(default_factory=dict)  # node name -> (shape, dtype) of its scratch (OpDef.workspace)
    storage: dict | None = None       # tensor (node: its workspace) -> arena view, valid for ``storage_arena``
    storage_arena: int = -1
    ran: bool = False                 # a run finished outside a dry pass (until then its runs are watched)


class Engine:
    """A compiled network. Build one with ``net.build_engine()``; see the module docstring."""

    def __init__(self, net: Network, backend, *, device=None, recorded: Network | None = None,
                 build_report: list[tuple[str, float, str]] | None = None, pass_report=None,
                 fold_constants: bool = True):
        self.net = net
        self.pass_report = pass_report          # graphdsl.passes.BuildReport (None: built without passes)
        self.fold_constants = fold_constants
        self._folded: dict = {}                 # tensor -> value computed once from bound weights
        self._folded_from: set[str] = set()     # weight names the folded values were computed from
        self._run_nodes = list(net.nodes)
        self.dump_dir: Path | None = None       # set by build_engine when dumping: kernels land here too
        self._kernels_dumped = 0
        self.recorded = recorded
        self.backend = backend
        self.device = None if device is None else torch.device(device)
        self.build_report = build_report or []
        self.cache_key: str | None = None       # the engine-cache entry this build was stored/loaded under
        self._weights: dict[str, torch.Tensor] = {}
        self._plans: dict[tuple, ShapePlan] = {}
        self._arenas: dict[torch.device, torch.Tensor] = {}
        self._arena_allocations: dict[torch.device, int] = {}   # arenas made per device (arena_id)
        self.last_plan: ShapePlan | None = None
        self.tapped: dict[str, torch.Tensor] = {}   # the last forward's taps (graphdsl.runtime.taps)
        self._tapsets: dict[tuple, TapSet] = {}
        used = {t for n in net.nodes for t in n.inputs} | set(net.outputs.values())
        self.required = [name for name, t in net.inputs.items() if t in used]
        self._aliases = {t for n in net.nodes for i, t in enumerate(n.outputs)
                         if n.category is OpCategory.VIEW or i in n.opdef.inplace}
        self.runtime_param_names = sorted({v.name for n in net.nodes for v in n.attrs.values()
                                           if isinstance(v, RuntimeParam)})

    # -- public surface ----------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return list(self.net.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.net.outputs)

    def arena_id(self, device) -> int:
        """An id of the memory arena the engine's plans use on ``device`` (0 before the first call):
        it changes when a step whose plan needs more memory regrows the arena, so a holder of the
        old arena's views (a captured CUDA graph) can tell its memory is no longer the engine's."""
        device = torch.device(device)
        return next((n for d, n in self._arena_allocations.items() if _same_device(d, device)), 0)

    def output_buffers(self, inputs: Mapping[str, torch.Tensor], runtime_params: Mapping | None = None
                       ) -> dict[str, torch.Tensor] | None:
        """New, unwritten buffers for the outputs of a forward on ``inputs``, if a plan of their shapes
        has run for real (its kernels compiled, its workspaces sized); else None. A CUDA-graph runner
        capturing a shape that already ran eagerly takes these instead of running it once more."""
        feed = {**self._weights, **inputs}
        if any(k not in feed for k in self.required):
            return None
        device = self._check_feed(feed)
        plan = self._plans.get(self._plan_key(feed, device, self._check_runtime_params(runtime_params)))
        return self._bind_outputs(None, plan, device) if plan is not None and plan.ran else None

    def _plan_key(self, feed: dict, device, params: dict) -> tuple:
        """What a shape plan is cached under: the device, each required input's shape and dtype, the
        runtime parameters."""
        return (device, tuple((k, tuple(feed[k].shape), feed[k].dtype) for k in self.required),
                tuple(sorted(params.items())))

    @property
    def num_launches(self) -> int:
        """Kernel launches per forward (what fusion and constant folding reduce)."""
        return self.backend.launches(self._run_nodes)

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Bind tensors once (weights) instead of passing them on every call; checked like inputs."""
        unknown = sorted(k for k in weights if k not in self.net.inputs)
        if unknown:
            raise BindError(f"set_weights: unknown names {unknown}; the graph's inputs are {self.input_names}")
        for name, w in weights.items():
            self._check_tensor(name, w, "weight")
            declared = self.net.inputs[name]
            if declared.shape is not None and all(isinstance(s, int) for s in declared.shape) \
                    and tuple(w.shape) != declared.shape:
                raise BindError(f"weight '{name}': expected shape {shape_str(declared.shape)}, got {list(w.shape)}")
        self._weights.update(weights)
        if self.fold_constants:
            self._fold()

    def _fold(self) -> None:
        """Evaluate the nodes that depend only on bound weights, once (constant folding)."""
        from graphdsl.passes.constant_fold import parameter_only_nodes
        nodes = parameter_only_nodes(self.net, set(self._weights))
        values = {t: self._weights[name] for name, t in self.net.inputs.items() if name in self._weights}
        for node in nodes:
            attrs = {k: v for k, v in node.attrs.items()}
            for t, r in zip(node.outputs, node.opdef.run([values[x] for x in node.inputs], attrs)):
                values[t] = r
        self._folded = {t: values[t] for n in nodes for t in n.outputs}
        folded_nodes = set(nodes)
        self._folded_from = {name for name, t in self.net.inputs.items()
                             if name in self._weights and any(t in n.inputs for n in nodes)}
        self._run_nodes = [n for n in self.net.nodes if n not in folded_nodes]

    def forward(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor] | None = None,
                runtime_params: Mapping | None = None, *, taps=None, after=None) -> dict[str, torch.Tensor]:
        """Run the engine; returns ``{output name: tensor}`` (the given buffers when passed).

        ``taps`` (see :mod:`graphdsl.runtime.taps`): selectors (a string or a list) whose tensors are
        copied out as the step runs into ``engine.tapped`` (``{tensor name: copy}``), or a dict
        ``{tensor name: buffer}`` to copy into in place (static buffers of a CUDA graph). Default:
        ``$GRAPHDSL_TAPS``. ``after(node, values)`` is a hook run after each node (profiles)."""
        if not isinstance(inputs, Mapping):
            raise BindError(f"forward: inputs must be a dict of name -> torch.Tensor, got {type(inputs).__name__}")
        unknown = sorted(k for k in inputs if k not in self.net.inputs)
        if unknown:
            raise BindError(f"forward: unknown inputs {unknown}; the graph's inputs are {self.input_names}")
        feed = {**self._weights, **inputs}
        missing = [k for k in self.required if k not in feed]
        if missing:
            raise BindError(f"forward: missing inputs {missing} (pass them, or bind weights once with set_weights)")
        device = self._check_feed(feed)
        params = self._check_runtime_params(runtime_params)
        key = self._plan_key(feed, device, params)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._specialise(feed, params)
        fresh = not plan.ran
        self.last_plan = plan
        storage = dict(self._storage(plan, device))
        outs = self._bind_outputs(outputs, plan, device)
        for name, t in self.net.outputs.items():
            if t.producer is not None and t not in self._aliases and t not in storage:
                storage[t] = outs[name]
        values = {t: feed[name] for name, t in self.net.inputs.items() if name in feed}
        nodes = self.net.nodes
        if self._folded and not self._folded_from.intersection(inputs):
            values.update(self._folded)
            nodes = self._run_nodes
        hook = after
        if taps is None:
            taps = taps_from_env() or None
        if taps is not None:
            buffers = dict(taps) if isinstance(taps, Mapping) else None
            tapset = self.tap_set(list(buffers) if buffers is not None else taps)
            copy, self.tapped = tapset.copier(values, buffers)
            if tapset.tensors:          # no hook for an empty selection (a hook makes the backend run every node)
                hook = copy if after is None else _chain(copy, after)
        with on_device(device):                 # Triton launches on the current GPU, not the tensors'
            values = self._run(fresh, plan, nodes, values, storage, hook, device)
        if not plan.ran:                        # a steady-state forward asks nothing more
            plan.ran = not dry_pass_running()
        if self.dump_dir is not None and len(getattr(self.backend, "sources", ())) != self._kernels_dumped:
            self._dump_kernels(self.dump_dir)
        for name, t in self.net.outputs.items():
            if values[t] is not outs[name]:
                outs[name].copy_(values[t])
        return outs

    __call__ = forward

    def _run(self, fresh: bool, plan: ShapePlan, nodes, values: dict, storage: dict, hook, device) -> dict:
        """The backend's run of ``nodes``; returns the values it filled in. On a backend that compiles
        ahead, a plan's runs are watched (:func:`~graphdsl.runtime.precompile.run_ahead`) until one
        finishes outside a dry pass (``fresh``: ``plan.ran`` not yet set): at the first Triton kernel
        missing from the disk cache the run turns dry (the arena zeroed), the missing kernels
        compile on worker processes, and the run starts again. Inside a caller's watch (a graph
        runner's step, a warm-up) the run is the caller's to repeat; the arena is zeroed if that
        watch is dry or turns dry meanwhile, so the dry ops read zeros, not an earlier step's
        indices."""
        arena = self._arenas.get(device)
        applies = getattr(self.backend, "ahead_applies", None)

        def run(values: dict) -> dict:
            self.backend.run(nodes, values, plan.attrs, storage, after=hook)
            return values
        if (fresh or watching()) and applies is not None and applies(nodes, device):
            return run_watched(lambda: run(dict(values)), self._plan_label(plan), again=lambda: run(values),
                               on_dry=None if arena is None else arena.zero_)
        if arena is not None and dry_pass_running():
            arena.zero_()
        return run(values)

    def profile(self, inputs: Mapping[str, torch.Tensor], **options):
        """Per-kernel times of one step on ``inputs``: a :class:`~graphdsl.runtime.profile.ProfileReport`
        (``print`` it; ``.chrome_trace(path)``, ``.svg(path)``). Options: ``warmup``, ``iters``,
        ``ceilings``, ``runtime_params``, ``name`` (see :func:`~graphdsl.runtime.profile.profile_engine`)."""
        from .profile import profile_engine
        return profile_engine(self, dict(inputs), **options)

    def tap_set(self, selectors) -> TapSet:
        """The tensors ``selectors`` name (resolved once per selector tuple and cached)."""
        key = (selectors,) if isinstance(selectors, str) else tuple(selectors)
        hit = self._tapsets.get(key)
        if hit is None:
            hit = self._tapsets[key] = TapSet(resolve_taps(self.net, key, self.recorded))
        return hit

    # -- validation --------------------------------------------------------------------------
    def _check_tensor(self, name: str, x, kind: str = "input") -> None:
        """``kind`` names the tensor as the caller does: an ``input`` of forward, a ``weight`` of set_weights."""
        if not isinstance(x, torch.Tensor):
            raise BindError(f"{kind} '{name}' must be a torch.Tensor, got {type(x).__name__}")
        want = self.net.inputs[name].dtype
        if want is not None and x.dtype != want:
            raise BindError(f"{kind} '{name}': expected dtype {dtype_str(want)}, got {dtype_str(x.dtype)}")

    def _check_feed(self, feed: dict) -> torch.device:
        device, first = self.device, None
        for name in self.required:
            x = feed[name]
            self._check_tensor(name, x)
            if device is None:
                device, first = x.device, name
            elif not _same_device(x.device, device):
                where = f"the engine's device {device}" if first is None else f"'{first}' is on {device}"
                raise BindError(f"input '{name}' is on {x.device}, but {where}; move all inputs to one device")
        declared = {n: self.net.inputs[n].shape for n in self.required if self.net.inputs[n].shape is not None}
        bind_shapes(declared, {n: tuple(feed[n].shape) for n in declared})
        return device if device is not None else torch.device("cpu")

    def _check_runtime_params(self, params) -> dict:
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.runtime_param_names))
        if unknown:
            raise BindError(f"forward: unknown runtime_params {unknown}; this graph takes {self.runtime_param_names}")
        missing = sorted(set(self.runtime_param_names) - set(params))
        if missing:
            raise BindError(f"forward: missing runtime_params {missing}")
        return params

    def _bind_outputs(self, outputs, plan: ShapePlan, device) -> dict[str, torch.Tensor]:
        outputs = dict(outputs or {})
        unknown = sorted(k for k in outputs if k not in self.net.outputs)
        if unknown:
            raise BindError(f"forward: unknown outputs {unknown}; the graph's outputs are {self.output_names}")
        outs = {}
        for name, t in self.net.outputs.items():
            shape, dtype = plan.specs[t.name]
            buf = outputs.get(name)
            if buf is None:
                outs[name] = torch.empty(shape, dtype=dtype, device=device)
                continue
            if not isinstance(buf, torch.Tensor):
                raise BindError(f"output '{name}' must be a torch.Tensor, got {type(buf).__name__}")
            if tuple(buf.shape) != shape or buf.dtype != dtype or not _same_device(buf.device, device):
                raise BindError(f"output '{name}': expected {list(shape)} {dtype_str(dtype)} on {device}, "
                                f"got {list(buf.shape)} {dtype_str(buf.dtype)} on {buf.device}")
            outs[name] = buf
        return outs

    # -- specialisation ----------------------------------------------------------------------
    def _specialise(self, feed: dict, params: dict) -> ShapePlan:
        declared = {n: self.net.inputs[n].shape for n in self.required if self.net.inputs[n].shape is not None}
        binding = bind_shapes(declared, {n: tuple(feed[n].shape) for n in declared})
        specs = {name: (tuple(feed[name].shape), feed[name].dtype) for name in self.required}
        attrs, workspaces = {}, {}
        for node in self.net.nodes:
            a = {k: _resolve(v, binding, params) for k, v in node.attrs.items()}
            attrs[node] = a
            ins = [Spec(*specs[t.name]) for t in node.inputs]
            try:
                outs = node.opdef.infer(ins, a)
                scratch = node.opdef.workspace_spec(ins, a)
            except GraphDSLError as e:
                detail = ", ".join(f"{t.name} {list(s.shape)} {dtype_str(s.dtype)}" for t, s in zip(node.inputs, ins))
                raise BindError(f"node '{node.name}' ({node.op} at {node.source}"
                                f"{', module ' + node.module if node.module else ''}) rejects this call's shapes "
                                f"({detail}): {e}") from None
            for t, s in zip(node.outputs, outs):
                specs[t.name] = (tuple(s.shape), s.dtype)
            if scratch is not None:
                workspaces[node.name] = (tuple(scratch.shape), scratch.dtype)
        return ShapePlan(binding, specs, attrs, plan_memory(self.net, specs, workspaces), workspaces)

    def _storage(self, plan: ShapePlan, device) -> dict:
        need = max(plan.memory.arena_bytes, 1)
        arena = self._arenas.get(device)
        if arena is None or arena.numel() < need:
            arena = self._arenas[device] = torch.empty(need, dtype=torch.uint8, device=device)
            self._arena_allocations[device] = self._arena_allocations.get(device, 0) + 1
        if plan.storage is None or plan.storage_arena != arena.data_ptr():
            by_name = {t.name: t for n in self.net.nodes for t in n.outputs}
            plan.storage = {}
            for name, (off, nbytes) in plan.memory.slots.items():
                shape, dtype = plan.specs[name]
                plan.storage[by_name[name]] = arena[off:off + nbytes].view(dtype).view(shape)
            nodes = {n.name: n for n in self.net.nodes}
            for name, (off, nbytes) in plan.memory.workspace_slots.items():   # keyed by the node itself
                shape, dtype = plan.workspaces[name]
                plan.storage[nodes[name]] = arena[off:off + nbytes].view(dtype).view(shape)
            plan.storage_arena = arena.data_ptr()
        return plan.storage

    # -- reports -----------------------------------------------------------------------------
    def summary(self) -> str:
        """Nodes, launches, inputs/outputs, build stages and each shape plan's arena use."""
        net = self.net
        rec = self.recorded
        lines = [f"Engine '{net.name}'  backend={self.backend.name}  device={self.device or 'from first call'}",
                 f"  nodes: {len(net.nodes)}" + (f" (recorded: {len(rec.nodes)})" if rec is not None else "")
                 + f"   kernel launches per forward: {self.num_launches}",
                 "  inputs:  " + ", ".join(self._describe(n, t) for n, t in net.inputs.items()),
                 f"  weights bound: {len(self._weights)}"
                 + (f"   folded constants: {len(self._folded)} (computed once from weights)" if self._folded else ""),
                 "  outputs: " + ", ".join(self._describe(n, t) for n, t in net.outputs.items())]
        fused = [n for n in self._run_nodes if n.op in FUSED_OPS]
        if fused:
            by_op: dict[str, int] = {}
            for n in fused:
                by_op[n.op] = by_op.get(n.op, 0) + 1
            absorbed = sum(len(n.attrs.get("absorbed", ())) for n in fused if n.op == "fused")
            lines.append(f"  fused kernels: {len(fused)} (" + ", ".join(f"{k} x{v}" for k, v in sorted(by_op.items()))
                         + f"; generic groups absorb {absorbed} recorded ops)")
        if self.build_report:
            lines.append("  build: " + ", ".join(f"{stage} {sec * 1e3:.1f} ms" + (f" ({info})" if info else "")
                                                 for stage, sec, info in self.build_report))
        lines.append(f"  shape plans: {len(self._plans)}")
        for plan in self._plans.values():
            m = plan.memory
            ratio = m.arena_bytes / m.intermediate_bytes if m.intermediate_bytes else 0.0
            dims = self._plan_label(plan)
            lines.append(f"    [{dims}] arena {_fmt_bytes(m.arena_bytes)} planned vs {_fmt_bytes(m.intermediate_bytes)} "
                         f"sum of intermediates ({ratio:.0%})")
        return "\n".join(lines)

    def _describe(self, name: str, t) -> str:
        """``name [shape] dtype``; a tensor declared without shape or dtype shows the last call's
        (or says that the first call decides)."""
        if t.shape is not None and t.dtype is not None:
            return f"{name} {shape_str(t.shape)} {dtype_str(t.dtype)}"
        if self.last_plan is None:
            return f"{name} (shape and dtype from the first call)"
        shape, dtype = self.last_plan.specs[t.name]
        return f"{name} {list(shape)} {dtype_str(dtype)} (last call)"

    def _plan_label(self, plan: ShapePlan) -> str:
        """What a shape plan is specialised on: its Dim values, else the shapes of shape-less inputs."""
        if plan.binding:
            return ", ".join(f"{k}={v}" for k, v in sorted(plan.binding.items()))
        free = [n for n in self.required if self.net.inputs[n].shape is None]
        return ", ".join(f"{n}={list(plan.specs[n][0])}" for n in free) or "static"

    def dump(self, directory) -> Path:
        """Write graph (txt/dot/json, recorded and optimised), memory plans and the summary."""
        d = Path(directory)
        if d.exists() and not d.is_dir():
            raise GraphDSLError(f"engine.dump: '{d}' is a file, not a folder")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:                              # a file of that name, permissions
            raise GraphDSLError(f"engine.dump: cannot create the folder '{d}': {e.strerror}") from None
        if self.recorded is not None:
            self.recorded.dump(d / "00-recorded.txt")
        for suffix in (".txt", ".dot", ".json"):
            self.net.dump(d / f"graph{suffix}")
        plans = [f"[{self._plan_label(p)}]\n{p.memory.describe()}" for p in self._plans.values()]
        (d / "plan.txt").write_text("\n\n".join(plans) + "\n" if plans else "no shape plan yet (no forward call)\n")
        (d / "summary.txt").write_text(self.summary() + "\n")
        if self.pass_report is not None:
            (d / "build_report.txt").write_text(str(self.pass_report) + "\n")
            (d / "fusion_report.txt").write_text(self.fusion_report() + "\n")
        self._dump_kernels(d)
        return d

    def _dump_kernels(self, d: Path) -> None:
        """Write each generated kernel's source (the Triton backend generates them per shape signature)."""
        sources = getattr(self.backend, "sources", {})
        if sources:
            (d / "kernels").mkdir(parents=True, exist_ok=True)
            for name, src in sources.items():
                (d / "kernels" / f"{name.replace(':', '_')}.py").write_text(src)
        self._kernels_dumped = len(sources)

    def fusion_report(self, *, rule: str | None = None) -> str:
        """"Why didn't this fuse?": per rule, what fused and each place that almost matched, with the
        reason (extra user, dtype, shape, disabled pass, ...), module path and source line."""
        rep = self.pass_report
        if rep is None:
            return "no fusion report: this engine was built without the pass manager"
        by_rule: dict[str, list] = {}
        for m in rep.near_misses:
            if rule is None or m.rule == rule:
                by_rule.setdefault(m.rule, []).append(m)
        applied: dict[str, int] = {}
        for r, _, _ in rep.applied:
            applied[r] = applied.get(r, 0) + 1
        names = sorted(set(by_rule) | ({r for r in applied if rule is None or r == rule}))
        lines = [f"fusion report for '{self.net.name}'"
                 + (f" (disabled passes: {', '.join(rep.disabled)})" if rep.disabled else "")]
        for r in names:
            misses = by_rule.get(r, [])
            lines.append(f"  {r}: fused {applied.get(r, 0)}, near misses {len(misses)}")
            for m in misses:
                lines.append(f"    - {m}")
        schemes: dict[str, int] = {}
        for n in self.net.nodes:
            if n.op == "quant_linear":
                schemes[n.attrs["scheme"]] = schemes.get(n.attrs["scheme"], 0) + 1
        if schemes and rule is None:
            lines.append("  quantized linears (quant_linear, no GEMV epilogue fusion): "
                         + ", ".join(f"{k} x{v}" for k, v in sorted(schemes.items())))
        if len(lines) == 1:
            lines.append("  nothing to report")
        return "\n".join(lines)


def _chain(first, second):
    def both(node, values):
        first(node, values)
        second(node, values)
    return both


def _resolve(v, binding, params):
    if isinstance(v, RuntimeParam):
        return params[v.name]
    if isinstance(v, DimExpr):
        return evaluate(v, binding)
    if isinstance(v, tuple):
        return tuple(_resolve(x, binding, params) for x in v)
    return v


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` (the current GPU) and ``cuda:0`` name one device when the current GPU is 0."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        cur = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index
