"""Per-kernel profiles of one engine step: ``engine.profile(inputs)``.

Each node the engine runs is one launch (views excepted). The step runs ``warmup`` times, then
``iters`` times timed per node. On CUDA the device first spins (``torch.cuda._sleep``) while the
host enqueues the whole step, so the times are the GPU's own, not the host's launch rate (what a
CUDA-graph replay gets too), and the kernels come from a ``torch.profiler`` (CUPTI) trace: each
node's launches are found through a profiler range around the node, and each kernel is charged
the time from the previous kernel's end to its own end (its own duration for the step's first),
so kernels that overlap under programmatic dependent launch are not counted twice and the
charges add up to the step's span on the device. Where the trace cannot be read, CUDA events
recorded between the launches time each node instead (they cost a few µs each and stop the
launches overlapping, so the sum then exceeds the step). On CPU ``time.perf_counter`` after
every node (the torch backend or the Triton interpreter runs each node synchronously). A node's
time is the median over the iterations. The step itself is timed without any of this
(``step_ms``), so ``sum(kernel ms) / step_ms`` says how faithful the per-node times are.

Per node the report gives the fused ops it absorbed, its time and share of the step, and its rate
against the device ceiling: bytes moved (every non-view input and output, once; a paged KV cache
read by attention counts only the rows ``seq_lens`` covers, one written in place only its new
rows, a gather such as ``embedding`` at most the bytes it writes) per second against the copy bandwidth, or for matmuls ``2 M N K`` FLOPs per second against
the matmul rate, whichever is the larger fraction.
:func:`measure_ceilings` measures both on the device (a copy and a square matmul).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.opdef import OpCategory

from .device import on_device

__all__ = ["KernelRow", "ProfileReport", "Ceilings", "measure_ceilings", "profile_engine"]


@dataclass(frozen=True)
class Ceilings:
    """What the device reaches: copy bandwidth (GB/s, read + written) and matmul rate (TFLOP/s)."""

    gbps: float
    tflops: float


def _time_ms(fn, device: torch.device, reps: int, hold_cycles: int = 0) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold_cycles:
            torch.cuda._sleep(hold_cycles)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def measure_ceilings(device, dtype=torch.bfloat16) -> Ceilings:
    """Copy bandwidth of 256 MiB (8 MiB on CPU) and the rate of an ``n x n`` matmul (n = 8192 on
    CUDA in ``dtype``, 256 in float32 on CPU)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = (256 << 20) if cuda else (8 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    gbps = 2 * nbytes / (_time_ms(lambda: dst.copy_(src), device, 20 if cuda else 5) * 1e-3) / 1e9
    n, dt = (8192, dtype) if cuda else (256, torch.float32)
    a = torch.randn(n, n, device=device).to(dt)
    c = torch.empty(n, n, device=device, dtype=dt)
    tflops = 2 * n ** 3 / (_time_ms(lambda: torch.matmul(a, a, out=c), device, 10 if cuda else 3) * 1e-3) / 1e12
    return Ceilings(gbps, tflops)


@dataclass
class KernelRow:
    """One launch of the step."""

    node: str
    op: str
    fused: tuple[str, ...]            # recorded ops the kernel absorbed (empty: itself)
    module: str
    ms: float
    share: float                      # of the measured step
    gbytes: float                     # bytes moved, in GB
    tflop: float                      # matmul work, in TFLOP (0 for other ops)
    ceiling: float = 0.0              # fraction of the device ceiling reached (the larger of the two)

    @property
    def gbps(self) -> float:
        return self.gbytes / (self.ms * 1e-3) if self.ms > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.tflop / (self.ms * 1e-3) if self.ms > 0 else 0.0


@dataclass
class ProfileReport:
    name: str
    device: str
    rows: list[KernelRow]             # sorted, slowest first
    step_ms: float                    # the step timed without per-node timestamps
    ceilings: Ceilings
    order: list[str] = field(default_factory=list)   # node names in launch order

    @property
    def kernel_ms(self) -> float:
        return sum(r.ms for r in self.rows)

    def table(self, top: int | None = None) -> str:
        rows = self.rows if top is None else self.rows[:top]
        w = max([len(r.node) for r in rows] + [6])
        lines = [f"{self.name} on {self.device}: step {self.step_ms:.3f} ms, kernels sum {self.kernel_ms:.3f} ms "
                 f"({self.kernel_ms / self.step_ms:.1%} of the step); ceilings {self.ceilings.gbps:.3g} GB/s, "
                 f"{self.ceilings.tflops:.3g} TFLOP/s",
                 f"{'kernel':<{w}}  {'op':<18} {'ms':>9} {'step':>6} {'GB/s':>8} {'TFLOP/s':>8} {'ceil':>5}  fused ops"]
        for r in rows:
            fused = ", ".join(r.fused) if r.fused else "-"
            lines.append(f"{r.node:<{w}}  {r.op[:18]:<18} {r.ms:9.4f} {r.share:6.1%} {r.gbps:8.1f} "
                         f"{r.tflops:8.2f} {r.ceiling:5.0%}  {fused[:60]}")
        if top is not None and len(self.rows) > top:
            rest = self.rows[top:]
            lines.append(f"... {len(rest)} more kernels, {sum(r.ms for r in rest):.4f} ms")
        return "\n".join(lines)

    __str__ = table

    def chrome_trace(self, path) -> Path:
        """Write the step as a Chrome trace (``chrome://tracing``, Perfetto): one slice per kernel, in
        launch order, each ``ms`` long."""
        by_name = {r.node: r for r in self.rows}
        events, ts = [], 0.0
        for name in self.order:
            r = by_name[name]
            events.append({"name": r.node, "cat": r.op, "ph": "X", "pid": 0, "tid": 0, "ts": round(ts, 3),
                           "dur": round(r.ms * 1e3, 3),
                           "args": {"op": r.op, "module": r.module, "fused": list(r.fused),
                                    "GB/s": round(r.gbps, 2), "TFLOP/s": round(r.tflops, 3),
                                    "ceiling": round(r.ceiling, 4)}})
            ts += r.ms * 1e3
        p = Path(path)
        p.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                 "otherData": {"step_ms": self.step_ms, "device": self.device}}, indent=1))
        return p

    def svg(self, path, top: int = 30) -> Path:
        """Write a bar chart (SVG) of the ``top`` slowest kernels: bar length = time, label = share and
        ceiling fraction."""
        rows = self.rows[:top]
        bar_w, row_h, left = 480, 18, 300
        longest = max((r.ms for r in rows), default=1.0) or 1.0
        height = row_h * (len(rows) + 2)
        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + bar_w + 220}" height="{height}" '
                 'font-family="monospace" font-size="11">',
                 f'<text x="4" y="13">{escape(self.name)}: step {self.step_ms:.3f} ms, kernels '
                 f'{self.kernel_ms:.3f} ms</text>']
        for i, r in enumerate(rows):
            y = row_h * (i + 1) + 4
            w = max(1.0, bar_w * r.ms / longest)
            parts.append(f'<text x="4" y="{y + 12}">{escape(r.node[:40])}</text>')
            parts.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{row_h - 4}" fill="#4a7ab5">'
                         f'<title>{escape(r.op)}: {escape(", ".join(r.fused) or "-")}</title></rect>')
            parts.append(f'<text x="{left + w + 4:.1f}" y="{y + 12}">{r.ms:.4f} ms {r.share:.1%} '
                         f'({r.ceiling:.0%} of ceiling)</text>')
        parts.append("</svg>")
        p = Path(path)
        p.write_text("\n".join(parts) + "\n")
        return p


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _work(node, ins: list, outs: list, attrs: dict, kv_rows: int) -> tuple[float, float]:
    """(bytes moved, FLOPs) of one node (see the module docstring)."""
    nbytes = 0
    updated = set(node.opdef.inplace.values())
    tokens = ins[0].shape[0] if ins and isinstance(ins[0], torch.Tensor) and ins[0].dim() else 0
    out_bytes = sum(_nbytes(x) for x in outs if isinstance(x, torch.Tensor))
    for i, x in enumerate(ins):
        if not isinstance(x, torch.Tensor):
            continue
        if x.dim() == 4 and i in updated:                  # a paged cache written in place: the new rows
            nbytes += tokens * x.shape[2] * x.shape[3] * x.element_size()
        elif node.category is OpCategory.ATTENTION and x.dim() == 4 and kv_rows:     # a paged cache read
            nbytes += kv_rows * x.shape[2] * x.shape[3] * x.element_size()
        elif node.category is OpCategory.DATA_MOVEMENT and i not in updated:
            nbytes += min(_nbytes(x), out_bytes)       # a gather (embedding rows) reads what it writes
        else:
            nbytes += _nbytes(x)
    written = set(node.opdef.inplace)
    nbytes += sum(_nbytes(x) for i, x in enumerate(outs) if isinstance(x, torch.Tensor) and i not in written)
    flops = 0.0
    if node.category is OpCategory.MATMUL and len(ins) >= 2 and ins[0].dim() >= 2:
        a, b = ins[0], ins[1]
        m = a.numel() // a.shape[-1] if not attrs.get("transpose_a") else a.shape[-1]
        k = a.shape[-2] if attrs.get("transpose_a") else a.shape[-1]
        n = b.shape[-2] if attrs.get("transpose_b") else b.shape[-1]
        flops = 2.0 * m * n * k * (b.numel() // (b.shape[-1] * b.shape[-2]) if b.dim() > 2 else 1)
    return float(nbytes), flops


# the recorded ops each pattern-fused op stands for (passes/fused_ops.py); generic ``fused`` groups
# list theirs in ``attrs["absorbed"]``
_PATTERN_OPS = {"add_rms_norm": ("add", "rms_norm"), "silu_mul": ("silu", "mul"),
                "rope_cache": ("rope", "reshape_and_cache"),
                "rope_cache_attention": ("rope", "reshape_and_cache", "paged_attention"),
                "matmul_add": ("matmul", "add"), "matmul_silu_mul": ("matmul", "silu", "mul"),
                "matmul_lora": ("matmul", "lora_apply"), "matmul_add_lora": ("matmul", "lora_apply", "add"),
                "matmul_silu_mul_lora": ("matmul", "lora_apply", "silu", "mul")}


def _fused_ops(node, recorded) -> tuple[str, ...]:
    absorbed = node.attrs.get("absorbed")
    if absorbed:
        ops = {n.name: n.op for n in recorded.nodes} if recorded is not None else {}
        return tuple(ops.get(a, a) for a in absorbed)
    return _PATTERN_OPS.get(node.op, ())


_LAUNCHES = ("LaunchKernel", "cuLaunch", "Memcpy", "Memset", "memcpy", "memset")


def _traced_samples(engine, inputs, runtime_params, hold: int, iters: int, shapes: dict):
    """``(node order, {node: [ms per iteration]})`` from a CUPTI trace (module docstring), or None
    when the trace has no kernels this can attribute (then CUDA events are used)."""
    import bisect

    from torch.profiler import ProfilerActivity, profile
    enter = torch.ops.profiler._record_function_enter_new
    leave = torch.ops.profiler._record_function_exit
    runs = []
    for it in range(iters):
        nodes, handle = [], [None]

        def after(node, values, nodes=nodes, handle=handle):
            leave(handle[0])
            nodes.append(node)
            if not shapes.get(node):
                shapes[node] = ([values[t] for t in node.inputs], [values[t] for t in node.outputs])
            handle[0] = enter(f"graphdsl:{len(nodes)}", None)

        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch.cuda._sleep(hold)
                handle[0] = enter("graphdsl:0", None)
                engine.forward(inputs, runtime_params=runtime_params, after=after)
                leave(handle[0])
                torch.cuda.synchronize()
            runs.append((nodes, prof.profiler.kineto_results.events()))
        except RuntimeError:          # no CUPTI here (or a profiler already running): time with events
            return None
    order, samples = [], {}
    for it, (nodes, events) in enumerate(runs):
        ranges = sorted((e.start_ns(), e.end_ns(), int(e.name().split(":")[1])) for e in events
                        if e.name().startswith("graphdsl:"))
        launch_at = {}
        for e in events:
            if e.device_type() == torch.autograd.DeviceType.CPU and any(k in e.name() for k in _LAUNCHES):
                launch_at[e.correlation_id()] = e.start_ns()
        kernels = []
        for e in events:
            if e.device_type() != torch.autograd.DeviceType.CUDA:
                continue
            t = launch_at.get(e.correlation_id(), launch_at.get(e.linked_correlation_id()))
            if t is None:
                continue
            k = bisect.bisect_right([r[0] for r in ranges], t) - 1
            if k >= 0 and t <= ranges[k][1] and ranges[k][2] < len(nodes):
                kernels.append((e.start_ns(), e.end_ns(), nodes[ranges[k][2]]))
        if not kernels:
            return None
        kernels.sort(key=lambda k: (k[0], k[1]))
        charge: dict = {}
        prev_end = kernels[0][0]
        for start, end, node in kernels:
            charge[node] = charge.get(node, 0.0) + max(end - prev_end, 0) / 1e6   # the gap before it included
            prev_end = max(prev_end, end)
        for node in nodes:
            if node.category is OpCategory.VIEW:
                continue
            if it == 0:
                order.append(node.name)
            samples.setdefault(node.name, []).append(charge.get(node, 0.0))
    return order, samples


def profile_engine(engine, inputs: dict, *, warmup: int = 2, iters: int = 5, ceilings: Ceilings | None = None,
                   runtime_params=None, name: str | None = None) -> ProfileReport:
    """Profile one step of ``engine`` on ``inputs`` (see the module docstring), with the inputs' GPU
    current: the timing events and the hold kernel go to the current device, as the launches do."""
    where = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    with on_device(where):
        return _profile_engine(engine, inputs, warmup=warmup, iters=iters, ceilings=ceilings,
                               runtime_params=runtime_params, name=name)


def _profile_engine(engine, inputs: dict, *, warmup: int, iters: int, ceilings: Ceilings | None,
                    runtime_params, name: str | None) -> ProfileReport:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise GraphDSLError(f"profile: iters must be an int >= 1, got {iters!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise GraphDSLError(f"profile: warmup must be an int >= 0, got {warmup!r}")
    for _ in range(max(warmup, 1)):
        engine.forward(inputs, runtime_params=runtime_params)
    device = engine.device or next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)),
                                   torch.device("cpu"))
    cuda = device.type == "cuda"
    hold = 0
    if cuda:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        engine.forward(inputs, runtime_params=runtime_params)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        # keep the GPU busy while the host enqueues the step (2 GHz, twice the host time, timestamps
        # included), so the times are the device's work, not the host's launch rate
        hold = int(min(4 * host_s, 1.0) * 2e9)

    shapes: dict = {}
    samples: dict[str, list[float]] = {}
    order: list[str] = []
    traced = _traced_samples(engine, inputs, runtime_params, hold, iters, shapes) if cuda else None
    if traced is not None:
        order, samples = traced
    for it in range(iters if traced is None else 0):
        stamps: list = []

        def after(node, values, stamps=stamps, first=(it == 0)):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                stamps.append((node, ev))
            else:
                stamps.append((node, time.perf_counter()))
            if first:
                shapes[node] = ([values[t] for t in node.inputs], [values[t] for t in node.outputs])

        if cuda:
            torch.cuda._sleep(hold)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        engine.forward(inputs, runtime_params=runtime_params, after=after)
        if cuda:
            torch.cuda.synchronize(device)
        prev = start
        for node, stamp in stamps:
            ms = prev.elapsed_time(stamp) if cuda else (stamp - prev) * 1e3
            prev = stamp
            if node.category is OpCategory.VIEW:
                continue
            if it == 0:
                order.append(node.name)
            samples.setdefault(node.name, []).append(ms)

    step_ms = statistics.median(_time_ms(lambda: engine.forward(inputs, runtime_params=runtime_params), device, 1,
                                         hold) for _ in range(iters))
    ceilings = ceilings or measure_ceilings(device)
    seq_lens = inputs.get("seq_lens")
    kv_rows = int(seq_lens.sum().item()) if isinstance(seq_lens, torch.Tensor) else 0
    by_name = {n.name: n for n in shapes}
    rows = []
    for node_name in order:
        node = by_name[node_name]
        ins, outs = shapes[node]
        nbytes, flops = _work(node, ins, outs, engine.last_plan.attrs[node], kv_rows)
        ms = statistics.median(samples[node_name])
        row = KernelRow(node_name, node.op, _fused_ops(node, engine.recorded), node.module, ms,
                        ms / step_ms if step_ms > 0 else 0.0, nbytes / 1e9, flops / 1e12)
        row.ceiling = max(row.gbps / ceilings.gbps if ceilings.gbps else 0.0,
                          row.tflops / ceilings.tflops if ceilings.tflops else 0.0)
        rows.append(row)
    rows.sort(key=lambda r: -r.ms)
    return ProfileReport(name or (engine.recorded or engine.net).name, str(device if not cuda else torch.cuda.get_device_name(device)),
                         rows, step_ms, ceilings, order)
