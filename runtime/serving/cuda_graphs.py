"""CUDA graphs for fixed-shape engine steps: decode, one captured graph per batch-size bucket
(:class:`CudaGraphRunner`); prefill steps already padded to a few shapes, one graph per shape
(:class:`ShapeGraphRunner`, at the end).

A decode step's launch overhead (a few hundred small kernels) dominates small-batch latency;
replaying a captured CUDA graph removes it. A graph fixes every shape and pointer, so:

* **buckets** — the batch (leading dim of every padded input) is padded up to the next of
  :data:`BUCKETS` (1, 2, 4, ..., 256); one graph per bucket, captured on first use;
* **padding** — each input declares a :class:`Pad`: the value of the padding rows (decode:
  ``slot_mapping = -1`` so nothing is written to the cache, ``seq_lens = 0`` so attention reads
  nothing and returns zeros, ids/positions/cos/sin/block-table rows 0) and optionally a fixed
  width for dim 1 (``block_tables`` is padded to the model's max blocks per sequence, so its shape
  never changes between steps);
* **widths** — optionally a bucket also has graphs at narrower widths of its one fixed-width input
  (``widths(bucket)``, ascending, ending with the :class:`Pad`'s): a step runs the graph of the
  narrowest width holding its table. The decode attention sizes its grid to the table's width (the
  longest context it could meet), so short contexts launch fewer programs through a narrower graph
  (:func:`~graphdsl.runtime.kernels.paged_attention.decode_widths` says which widths change it).
  Graphs are keyed ``(bucket, width)`` (width None without a fixed-width input);
* **static buffers** — per bucket, input buffers the step's tensors are copied into and the output
  buffers the graph writes; results are returned as copies of the first ``n`` rows;
* **capture** — one eager warm-up ``engine.forward`` on a side stream (specialises the engine's
  shape plan, compiles the Triton kernels, sizes the backend's workspaces), then the same call is
  captured with the output buffers given, so the captured region allocates nothing of its own:
  the plan's arena slots, the backend's split-K workspaces and the outputs already exist. The
  arena views of a captured plan are held by the runner, so a later, larger plan that regrows the
  engine's arena cannot free memory a graph still writes to. The capture itself is
  :func:`capturing`, ``torch.cuda.graph`` without what it does first (a device-wide
  synchronisation and emptying torch's device and pinned-host caches, which later steps then
  allocate again);
* **prologue** — inputs computed from other inputs on the device (decode's RoPE cos/sin from the
  positions, the cache slots from positions and block tables) can be captured too: the runner
  calls it before the engine in the warm-up and in the capture, and holds what the captured call
  allocated. Their host-side launches leave the step;
* **epilogue** — work after the engine (the greedy argmax of the logits, advancing the static
  inputs to the next step) is captured too, but not run in the warm-up, so it may update inputs;
* **taps** — with ``taps`` (selectors, default ``$GRAPHDSL_TAPS``; see :mod:`graphdsl.runtime.taps`)
  the warm-up's tap copies become the bucket's static tap buffers and the capture copies into
  them, so every replay refreshes them; ``runner.tapped`` holds the last replay's (``[bucket, ...]``
  rows, padding included);
* **static use** — the serving loop writes a bucket's static inputs itself (:meth:`static_inputs`,
  advanced in place between steps) and calls :meth:`replay` with no copy at all;
* **dry passes** — nothing is captured inside one (:mod:`graphdsl.runtime.precompile`; a warm-up's
  watch that turned dry at a kernel missing from the disk cache spans many steps): a new bucket's
  step runs as its first step does, launching nothing, and its outputs are returned uncaptured; the
  step is captured when it next comes outside the dry pass.

The warm-up computes the same step the replay then repeats (cache writes are idempotent), so the
first step of a bucket is correct too. :func:`pad_batch` is the same padding as plain tensors, for
running a padded batch eagerly (how the CPU tests check that padding changes no real row).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from graphdsl.errors import BindError, GraphDSLError
from graphdsl.runtime.precompile import dry_pass_running
from graphdsl.runtime.taps import taps_from_env

__all__ = ["BUCKETS", "Pad", "bucket_for", "pad_batch", "packed_inputs", "capture_stream", "capturing",
           "CudaGraphRunner", "ShapeGraphRunner"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_MAX_SEEN = 4096       # shape signatures a ShapeGraphRunner counts before it forgets them all
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pad:
    """How one batch-major input is padded: rows ``n..bucket`` (and, with ``width``, columns
    ``cols..width`` of 2-D inputs) are filled with ``value``."""

    value: int | float = 0
    width: int | None = None


def bucket_for(n: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket ``>= n`` (None when ``n`` exceeds the largest)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GraphDSLError(f"bucket_for: n must be a positive int, got {n!r}")
    for b in buckets:
        if b >= n:
            return b
    return None


def _batch(inputs: Mapping[str, torch.Tensor], pads: Mapping[str, Pad]) -> int:
    missing = sorted(set(pads) - set(inputs))
    if missing:
        raise BindError(f"padded batch: missing inputs {missing}")
    unknown = sorted(set(inputs) - set(pads))
    if unknown:
        raise BindError(f"padded batch: inputs {unknown} have no Pad (padded inputs are {sorted(pads)})")
    sizes = {name: x.shape[0] for name, x in inputs.items()}
    if len(set(sizes.values())) != 1:
        raise BindError(f"padded batch: every input's dim 0 must be the batch size, got {sizes}")
    return next(iter(sizes.values()))


def _check_width(name: str, x: torch.Tensor, pad: Pad) -> None:
    if pad.width is not None and (x.dim() != 2 or x.shape[1] > pad.width):
        raise BindError(f"input '{name}': expected a 2-D tensor at most {pad.width} wide (its fixed padded width), "
                        f"got shape {list(x.shape)}")


def _fill(dst: torch.Tensor, x: torch.Tensor, n: int, pad: Pad) -> None:
    """``dst[:n] = x`` (columns past ``x``'s width and rows ``n:`` set to ``pad.value``)."""
    if pad.width is not None and x.shape[1] < pad.width:
        dst[:n, :x.shape[1]].copy_(x)
        dst[:n, x.shape[1]:].fill_(pad.value)
    else:
        dst[:n].copy_(x)
    if n < dst.shape[0]:
        dst[n:].fill_(pad.value)


def _padded_shape(x: torch.Tensor, rows: int, pad: Pad) -> tuple[int, ...]:
    shape = [rows, *x.shape[1:]]
    if pad.width is not None:
        shape[1] = pad.width
    return tuple(shape)


def pad_batch(inputs: Mapping[str, torch.Tensor], pads: Mapping[str, Pad], rows: int) -> dict[str, torch.Tensor]:
    """New tensors: each input padded to ``rows`` rows (and its fixed width) as its :class:`Pad` says."""
    n = _batch(inputs, pads)
    if rows < n:
        raise BindError(f"pad_batch: rows must be >= the batch size {n}, got {rows}")
    out = {}
    for name, x in inputs.items():
        _check_width(name, x, pads[name])
        dst = torch.empty(_padded_shape(x, rows, pads[name]), dtype=x.dtype, device=x.device)
        _fill(dst, x, n, pads[name])
        out[name] = dst
    return out


@dataclass
class _Graph:
    graph: object                          # torch.cuda.CUDAGraph (None: a step that ran dry, not captured)
    inputs: dict[str, torch.Tensor]        # static input buffers, [bucket, ...]
    outputs: dict[str, torch.Tensor]       # static output buffers the graph writes
    keep: list = field(default_factory=list)   # arena views the captured kernels address
    extent: dict = field(default_factory=dict)  # input -> (rows, width) that may hold non-pad values
    taps: dict = field(default_factory=dict)    # tensor name -> static tap buffer the graph copies into
    arena: int = 0                         # the engine's arena_id when captured (ShapeGraphRunner)


class CudaGraphRunner:
    """Runs ``engine`` through CUDA graphs keyed by batch bucket.

    Args:
        engine: a built :class:`~graphdsl.runtime.Engine` on CUDA whose weights are bound; its
            remaining inputs are the names in ``pads`` (batch-major) and what ``prologue`` adds,
            and every output is batch-major.
        pads: per input name, its :class:`Pad`.
        buckets: the batch sizes graphs are captured for (ascending).
        prologue: optional ``fn(static inputs) -> {name: tensor}``, more engine inputs computed from
            the padded ones by device-side torch ops (no host synchronisation); it is captured
            into the graph, so its work costs no launches of its own (the RoPE tables from the
            positions, for decode). Padded inputs the engine does not take are the prologue's.
        widths: optional ``fn(bucket) -> widths``: the widths of the one fixed-width input that
            ``bucket`` has graphs at (module docstring); default: its :class:`Pad` width alone.
    """

    def __init__(self, engine, pads: Mapping[str, Pad], *, buckets=BUCKETS, prologue=None, epilogue=None,
                 taps=None, widths=None):
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise GraphDSLError(f"CudaGraphRunner: buckets must be ascending positive ints, got {buckets!r}")
        for name, fn in (("prologue", prologue), ("epilogue", epilogue)):
            if fn is not None and not callable(fn):
                raise GraphDSLError(f"CudaGraphRunner: {name} must be callable or None, got {fn!r}")
        self.engine = engine
        self.pads = dict(pads)
        self.prologue, self.epilogue = prologue, epilogue
        self._static: dict[tuple, dict[str, torch.Tensor]] = {}
        self.buckets = tuple(buckets)
        self.graphs: dict[tuple[int, int | None], _Graph] = {}    # (bucket, width) -> graph
        wide = [k for k, p in self.pads.items() if p.width is not None]
        if widths is not None and (len(wide) != 1 or not callable(widths)):
            raise GraphDSLError(f"CudaGraphRunner: widths needs a callable and exactly one input with a fixed "
                                f"width, got {widths!r} and {wide}")
        self._wide = wide[0] if len(wide) == 1 else None      # the input whose width may narrow
        self._widths_fn = widths
        self._widths: dict[int, tuple[int, ...]] = {}
        self._pool = None
        self.taps = list(taps_from_env() if taps is None else ([taps] if isinstance(taps, str) else taps))
        self.tapped: dict[str, torch.Tensor] = {}   # the last replay's static tap buffers

    def fits(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Whether a step with these inputs can replay a graph (batch within the largest bucket,
        fixed-width inputs not wider than their width)."""
        n = _batch(inputs, self.pads)
        if n < 1 or n > self.buckets[-1]:
            return False
        return all(p.width is None or (inputs[k].dim() == 2 and inputs[k].shape[1] <= p.width)
                   for k, p in self.pads.items())

    def widths(self, bucket: int) -> tuple[int, ...]:
        """The widths ``bucket`` has graphs at, ascending (``()`` without a fixed-width input)."""
        if self._wide is None:
            return ()
        out = self._widths.get(bucket)
        if out is None:
            top = self.pads[self._wide].width
            got = tuple(self._widths_fn(bucket)) if self._widths_fn is not None else (top,)
            if list(got) != sorted(set(got)) or any(isinstance(w, bool) or not isinstance(w, int) or not 0 < w <= top
                                                    for w in got):
                raise GraphDSLError(f"CudaGraphRunner: widths({bucket}) must be ascending ints in [1, {top}], "
                                    f"got {got!r}")
            out = self._widths[bucket] = tuple(w for w in got if w < top) + (top,)
        return out

    def width_for(self, bucket: int, width: int | None = None) -> int | None:
        """The narrowest width of ``bucket``'s graphs holding ``width`` columns (None: the widest;
        None without a fixed-width input)."""
        widths = self.widths(bucket)
        if not widths:
            return None
        if width is None:
            return widths[-1]
        for w in widths:
            if w >= width:
                return w
        raise BindError(f"input '{self._wide}': expected at most {widths[-1]} columns (its fixed padded width), "
                        f"got {width}")

    def _pads_at(self, width: int | None) -> dict[str, Pad]:
        if self._wide is None or width == self.pads[self._wide].width:
            return self.pads
        return {**self.pads, self._wide: Pad(self.pads[self._wide].value, width)}

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step: pad into the static inputs of the bucket (and the narrowest width holding the
        step), replay (capturing on first use), and return copies of the outputs' first ``n`` rows."""
        n = _batch(inputs, self.pads)
        bucket = bucket_for(n, self.buckets) if n >= 1 else None
        if bucket is None:
            raise BindError(f"CudaGraphRunner: batch size must be in [1, {self.buckets[-1]}], got {n}")
        width = None
        if self._wide is not None:
            _check_width(self._wide, inputs[self._wide], self.pads[self._wide])
            width = self.width_for(bucket, inputs[self._wide].shape[1])
        pads = self._pads_at(width)
        entry = self.graphs.get((bucket, width))
        if entry is None:
            static = pad_batch(inputs, pads, bucket)
            entry = self._capture(bucket, static)
            if entry.graph is None:                    # a dry pass: the step ran, nothing was captured
                return {name: buf[:n].clone() for name, buf in entry.outputs.items()}
            self.graphs[(bucket, width)] = entry
            entry.extent = {name: (n, x.shape[1] if pads[name].width is not None else None)
                            for name, x in inputs.items()}
        else:
            self._load(entry, inputs, n, pads)
        entry.graph.replay()
        self.tapped = entry.taps
        return {name: buf[:n].clone() for name, buf in entry.outputs.items()}

    def static_inputs(self, bucket: int, like: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                      device, width: int | None = None) -> dict[str, torch.Tensor]:
        """The static input buffers of the graph of ``bucket`` at ``width`` (one of
        :meth:`widths`; None: the widest), made on first use filled with their pad values:
        ``like[name] = (shape of one row, dtype)``. The caller writes them in place; :meth:`replay`
        runs the graph over what they hold. They are views of one buffer (:func:`packed_inputs`
        gives it whole), so a tensor-parallel rank 0 sends all of them to the other ranks in one
        broadcast."""
        key = self._key(bucket, width)
        entry = self.graphs.get(key)
        if entry is not None:
            return entry.inputs
        static = self._static.get(key)
        if static is None:
            specs = {}
            for name, pad in self._pads_at(key[1]).items():
                row, dtype = like[name]
                shape = (bucket, *row)
                if pad.width is not None:
                    shape = (bucket, pad.width, *row[1:])
                specs[name] = (shape, dtype)
            static = _packed_buffers(specs, device)
            for name, pad in self._pads_at(key[1]).items():
                static[name].fill_(pad.value)
            self._static[key] = static
        return static

    def _key(self, bucket: int, width: int | None) -> tuple[int, int | None]:
        if bucket not in self.buckets:
            raise GraphDSLError(f"CudaGraphRunner: bucket must be one of {self.buckets}, got {bucket}")
        key = (bucket, self.width_for(bucket, width))
        if width is not None and key[1] != width:
            raise GraphDSLError(f"CudaGraphRunner: width must be one of {self.widths(bucket)} for bucket {bucket}, "
                                f"got {width}")
        return key

    def replay(self, bucket: int, width: int | None = None) -> dict[str, torch.Tensor]:
        """Run the graph of ``bucket`` at ``width`` (None: the widest) over its static inputs
        (capturing it on first use) and return its output buffers themselves (``[bucket, ...]``,
        valid until the next replay)."""
        key = self._key(bucket, width)
        entry = self.graphs.get(key)
        if entry is None:
            static = self._static.get(key)
            if static is None:
                raise GraphDSLError(f"CudaGraphRunner.replay: bucket {bucket} (width {key[1]}) has no static "
                                    "inputs; call static_inputs first")
            entry = self._capture(bucket, static)
            if entry.graph is None:                    # a dry pass: the step ran, nothing was captured
                return entry.outputs
            del self._static[key]
            self.graphs[key] = entry
        entry.extent = {}        # the caller wrote the buffers: a later run() refills all padding
        entry.graph.replay()
        self.tapped = entry.taps
        return entry.outputs

    def _load(self, entry: _Graph, inputs, n: int, pads: Mapping[str, Pad]) -> None:
        """Copy the step into the static buffers with as few launches as the padding allows: full-width
        inputs go in one ``_foreach_copy_`` per dtype, and padding is rewritten only where an earlier
        step left values (``entry.extent``), so a step no wider than the last one fills nothing."""
        copies = []
        for name, x in inputs.items():
            dst, pad = entry.inputs[name], pads[name]
            if x.dtype != dst.dtype or x.device != dst.device or tuple(x.shape[2:]) != tuple(dst.shape[2:]) \
                    or (pad.width is None and x.shape[1:] != dst.shape[1:]):
                raise BindError(f"input '{name}': expected [n, {', '.join(map(str, dst.shape[1:]))}] "
                                f"{dst.dtype} on {dst.device} (the captured graph's), got {list(x.shape)} "
                                f"{x.dtype} on {x.device}")
            _check_width(name, x, pad)
            rows, width = entry.extent.get(name, (dst.shape[0], None))
            w = x.shape[1] if pad.width is not None else None
            if w is not None and w < pad.width:
                dst[:n, :w].copy_(x)
                if width is None or w < width:
                    dst[:n, w:width].fill_(pad.value)
            else:
                copies.append((dst[:n], x))
            if n < rows:
                dst[n:rows].fill_(pad.value)
            entry.extent[name] = (n, w)
        _copy_by_dtype(copies)

    def _capture(self, bucket: int, static: dict[str, torch.Tensor]) -> _Graph:
        engine = self.engine
        device = next(iter(static.values())).device
        if device.type != "cuda":
            raise GraphDSLError(f"CudaGraphRunner: CUDA graphs need CUDA inputs, got device {device}")
        outputs = self._first_step(bucket, static, device)
        if dry_pass_running():     # a watch spanning several steps (a warm-up) turned dry: capture nothing
            extra = dict(self.epilogue(static, outputs)) if self.epilogue is not None else {}
            return _Graph(None, static, {**outputs, **extra})
        tap_buffers = dict(engine.tapped) if self.taps else {}
        for name, buf in outputs.items():
            if buf.dim() == 0 or buf.shape[0] != bucket:
                raise GraphDSLError(f"CudaGraphRunner: output '{name}' must be batch-major ([{bucket}, ...]), "
                                    f"got {list(buf.shape)}")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        made: list = []
        with capturing(graph, self._pool, device):
            engine.forward(self._feed(static, made), outputs, taps=tap_buffers)
            extra = dict(self.epilogue(static, outputs)) if self.epilogue is not None else {}
        return _Graph(graph, static, {**outputs, **extra}, _arena_views(engine) + made, taps=tap_buffers)

    def _first_step(self, bucket: int, static: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
        """The step once before its capture — prologue, the engine's forward (:func:`_warm_up`),
        epilogue — which compiles its kernels, plans the shape and sizes the workspaces; returns the
        forward's outputs. The epilogue runs on copies of the static buffers (it advances them), so
        that what it allocates or compiles on first use (the draw's arrival counters) is not captured
        as work.

        Where the engine's backend compiles ahead, the step runs watched
        (:func:`graphdsl.runtime.precompile.run_ahead`): at the first Triton kernel missing from the
        disk cache the rest of the step goes dry, every kernel it was missing — the prologue's, the
        forward's, the epilogue's — compiles on worker processes in one round, and the step runs
        again. In a dry part the prologue's outputs, left unwritten, are zeroed (zeros are a valid
        index for any torch op that reads them) and the engine zeroes its arena."""
        from graphdsl.runtime import precompile

        def step() -> dict[str, torch.Tensor]:
            outputs = _warm_up(self.engine, self._feed(static, [], dry=True), device, self.taps or {})
            if self.epilogue is not None:
                self.epilogue({k: v.clone() for k, v in static.items()}, outputs)
            return outputs
        applies = getattr(self.engine.backend, "ahead_applies", None)
        if applies is None or not applies(self.engine.net.nodes, device):
            return step()
        return precompile.run_watched(step, f"graph step, {bucket} rows")

    def _feed(self, static: dict, made: list, dry: bool = False) -> dict:
        """The engine's inputs: the static buffers and what the prologue computes from them (its
        tensors appended to ``made``: a graph keeps the memory it was captured with). ``dry``: zero
        the prologue's tensors if a dry pass skipped the launches that would have written them."""
        if self.prologue is None:
            return static
        extra = dict(self.prologue(static))
        if dry and dry_pass_running():
            for v in extra.values():
                v.zero_()
        made.extend(extra.values())
        names = self.engine.net.inputs
        return {k: v for k, v in {**static, **extra}.items() if k in names}


class ShapeGraphRunner:
    """Runs ``engine`` through CUDA graphs keyed by the exact shapes of its inputs: for steps the
    caller has already padded to a few shapes (the serving loop's prefill steps, :mod:`.prefill_pad`),
    whose host work — a launch per node, a couple of hundred nodes — costs more than the device
    time of a short prompt.

    * A shape signature runs eagerly the first ``capture_after`` times it is seen (the engine's plan
      is specialised and its kernels compiled then; a shape seen once costs no capture), then is
      captured as :class:`CudaGraphRunner` captures a bucket (a warm-up on a side stream, then the
      captured call writing the warm-up's outputs; with ``capture_after`` 1 or more the eager runs
      were the warm-up, and the engine only makes the output buffers), and replays from then on:
      the step's tensors are copied into the graph's static inputs (one ``_foreach_copy_`` per
      dtype) and the outputs returned as copies.
    * Only steps of at most ``max_rows`` rows (the inputs' longest leading dim: a prefill's tokens)
      are captured: past that the device time covers the host's launches anyway.
    * A graph holds the arena it was captured on. When a larger step has regrown the engine's
      arena (:meth:`~graphdsl.runtime.Engine.arena_id` changed), the next call drops every graph of
      an older arena, which frees that arena; their shapes are captured again when they come.
    * At most ``max_graphs`` graphs are kept, the least recently replayed dropped first (with the
      arena views it held).
    * Graphs write outputs of the same shape and dtype into one shared buffer (a prefill step's
      logits ``[rows, vocab]`` are the same for every token bucket once the rows are padded to the
      loop's sequence count): replays run one after another on one stream and :meth:`run` returns
      copies, so a graph's memory is its static inputs, not a logits buffer each.

    The replayed step computes what the eager step computes: same plan, kernels and pointers (the
    engine's arena views are held by the graph), every input copied in. Steps with taps
    (``$GRAPHDSL_TAPS``) run eagerly, and so, after one logged warning, does a shape whose capture
    failed (an op that synchronises with the host)."""

    def __init__(self, engine, *, max_rows: int = 2048, max_graphs: int = 32, capture_after: int = 1):
        for name, v, lo in (("max_rows", max_rows, 1), ("max_graphs", max_graphs, 1), ("capture_after", capture_after, 0)):
            if not isinstance(v, int) or v < lo:
                raise GraphDSLError(f"ShapeGraphRunner: {name} must be an int >= {lo}, got {v!r}")
        self.engine = engine
        self.max_rows, self.max_graphs, self.capture_after = max_rows, max_graphs, capture_after
        self.graphs: dict[tuple, _Graph] = {}     # insertion order = least recently replayed first
        self.outputs: dict[tuple, torch.Tensor] = {}   # (name, shape, dtype, device) -> the graphs' shared buffer
        self.seen: dict[tuple, int] = {}
        self.failed: set[tuple] = set()            # shapes whose capture raised: always eager
        self._pool = None
        self._arena_now = 0                        # the engine's arena_id at the last call

    @staticmethod
    def signature(inputs: Mapping[str, torch.Tensor]) -> tuple:
        return tuple((k, tuple(x.shape), x.dtype, x.device) for k, x in sorted(inputs.items()))

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The step's outputs through a graph (copies), or None when the caller should run it
        eagerly (a shape not yet captured, too many rows, taps, not CUDA, inside a dry pass: a
        warm-up's watch that turned dry captures and counts nothing)."""
        if not self.capturable(inputs) or dry_pass_running():
            return None
        sig = self.signature(inputs)
        if sig in self.failed:
            return None
        arena = self._arena(inputs)
        if arena != self._arena_now:                 # regrown since: let the old arena go
            self.graphs = {k: g for k, g in self.graphs.items() if g.arena == arena}
            self._arena_now = arena
        entry = self.graphs.pop(sig, None)
        if entry is None:
            if len(self.seen) >= _MAX_SEEN:           # unpadded steps: every step a new shape
                self.seen.clear()
            count = self.seen[sig] = self.seen.get(sig, 0) + 1
            if count <= self.capture_after:
                return None
            static = {k: x.clone() for k, x in inputs.items()}
            try:
                entry = self._capture(static, ran=count > 1)
            except RuntimeError as e:                # a host sync inside the step: never capture this shape
                self.failed.add(sig)
                _log.warning("ShapeGraphRunner: the step of shapes %s could not be captured, it runs eagerly "
                             "from now on: %s", {k: list(x.shape) for k, x in inputs.items()}, e)
                return None
            if entry.graph is None:                    # its warm-up turned a watch dry: nothing captured
                return {name: buf.clone() for name, buf in entry.outputs.items()}
            while len(self.graphs) >= self.max_graphs:
                self.graphs.pop(next(iter(self.graphs)))
        else:
            _copy_by_dtype([(entry.inputs[k], x) for k, x in inputs.items()])
        self.graphs[sig] = entry
        entry.graph.replay()
        return {name: buf.clone() for name, buf in entry.outputs.items()}

    def capturable(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """CUDA inputs of at most ``max_rows`` rows (the longest leading dim), and no taps."""
        rows = max((x.shape[0] for x in inputs.values() if x.dim()), default=0)
        return (0 < rows <= self.max_rows and all(x.device.type == "cuda" for x in inputs.values())
                and not taps_from_env())

    def _arena(self, inputs: Mapping[str, torch.Tensor]) -> int:
        return self.engine.arena_id(next(iter(inputs.values())).device)

    def _graph_pool(self):
        """The memory pool the next capture shares with the kept graphs: a fresh one when none is
        kept. Once every graph of a pool is gone (the arena regrew) the allocator counts the pool
        unused and refuses a capture into it ("use_count > 0" internal assert), and the shape would
        then run eagerly for good; the old pool's memory is freed with it."""
        if self._pool is None or not self.graphs:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _capture(self, static: dict[str, torch.Tensor], ran: bool = False) -> _Graph:
        """Capture the step on ``static``. Its warm-up is the engine's :meth:`~graphdsl.runtime.Engine.
        output_buffers` when the shape has already run eagerly here (``ran``: the caller ran it
        when :meth:`run` returned None, so its plan is made and its kernels compiled), else an eager
        run (:func:`_warm_up`): a warm-up's prefill graphs cost three forwards a bucket before, two now."""
        engine = self.engine
        device = next(iter(static.values())).device
        outputs = engine.output_buffers(static) if ran else None
        if outputs is None:
            outputs = _warm_up(engine, static, device, {})
        if dry_pass_running():
            return _Graph(None, static, outputs)
        outputs = {name: self.outputs.setdefault((name, tuple(x.shape), x.dtype, x.device), x)
                   for name, x in outputs.items()}
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._graph_pool(), device):
            engine.forward(static, outputs, taps={})
        return _Graph(graph, static, outputs, _arena_views(engine), arena=self._arena(static))


_ALIGN = 16     # bytes: every view of a packed buffer starts at a multiple of this


def _packed_buffers(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device) -> dict[str, torch.Tensor]:
    """``{name: tensor of specs[name] = (shape, dtype)}``, all views of one byte buffer, in order."""
    places, total = {}, 0
    for name, (shape, dtype) in specs.items():
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        places[name] = (total, nbytes)
        total += -(-nbytes // _ALIGN) * _ALIGN
    storage = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=device)
    return {name: storage[at:at + nbytes].view(specs[name][1]).view(specs[name][0])
            for name, (at, nbytes) in places.items()}


def packed_inputs(static: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The one byte buffer under the static inputs ``static`` (from :meth:`CudaGraphRunner.static_inputs`):
    copying it copies them all."""
    first = next(iter(static.values()))
    storage = first.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in static.values()):
        raise GraphDSLError("packed_inputs: the static inputs are not views of one buffer")
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (storage.nbytes(),))


def _copy_by_dtype(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair, in one ``_foreach_copy_`` launch per source dtype."""
    groups: dict = {}
    for dst, src in pairs:
        dsts, srcs = groups.setdefault(src.dtype, ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device) -> torch.cuda.Stream:
    """The stream every capture on CUDA ``device`` runs on (one a device, made on first use).
    ``torch.cuda.graph`` without ``stream=`` captures on a single stream it makes on whichever device
    is current at its first use, and entering that stream makes its device current. A model split
    over two GPUs (a ``transfer_map``) then captured its second GPU's part on the first GPU's
    stream: those kernels ran on the first GPU over the second's memory, which gave wrong tokens
    through peer access and an illegal address without it (two H200s, session 42)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool, device):
    """Capture the block's CUDA work on ``device`` into ``graph`` (memory from ``pool``), on
    :func:`capture_stream`, ordered after the work already queued on the current stream.

    ``torch.cuda.graph`` first synchronises the device, then empties torch's caching allocator and
    its pinned-host cache. The steps after a capture then allocate that memory again, including
    the pinned buffers the serving loop reads tokens back through (``cudaHostAlloc``, which
    synchronises). A warm-up captures about 60 graphs in a row, and a server captures a prefill
    shape the warm-up did not meet while it serves. Here the capture stream waits on the current
    stream instead of the host waiting on the device, and no cache is emptied: the caller's
    warm-up has allocated what the step needs, so the captured region allocates (almost) nothing."""
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            yield graph
        finally:
            graph.capture_end()


def _warm_up(engine, feed: dict, device, taps) -> dict[str, torch.Tensor]:
    """The eager ``engine.forward`` before a capture, on a side stream: it specialises the shape plan,
    compiles the Triton kernels and sizes the backend's workspaces. Returns its outputs (the
    buffers the captured call then writes)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        outputs = engine.forward(feed, taps=taps)
    torch.cuda.current_stream(device).wait_stream(side)
    return outputs


def _arena_views(engine) -> list:
    """The arena views of the engine's last plan. A graph holds them, so a later, larger plan that
    regrows the arena cannot free memory the graph still writes to."""
    plan = engine.last_plan
    return list(plan.storage.values()) if plan is not None and plan.storage else []
