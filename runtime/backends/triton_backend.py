"""The Triton backend: generated kernels for fused groups, cuBLAS (through torch) for matmuls.

Per node, by what the node is:

* ``fused``, ``add_rms_norm``, ``silu_mul`` — one generated ``@triton.jit`` kernel each
  (:mod:`graphdsl.runtime.codegen.fused`), writing straight into the node's arena slot;
* ``rope_cache`` — its own kernel (:mod:`graphdsl.runtime.codegen.rope_cache`), caches in place;
* ``paged_attention`` — :func:`~graphdsl.runtime.kernels.paged_attention_prefill` when the node
  has a ``query_start_loc`` input, else :func:`~graphdsl.runtime.kernels.paged_attention_decode`
  (its split-K workspace kept by the backend, so a CUDA-graph replay allocates nothing), writing
  into the node's slot; ``rope_cache_attention`` — the same decode kernel also rotating q and k and
  writing the cache; ``reshape_and_cache`` — the Triton cache-write kernel, in place;
  ``paged_mla_attention`` — :func:`~graphdsl.runtime.kernels.paged_mla_attention.paged_mla_attention`
  (its split scratch kept like the decode's); ``moe_experts`` — the sparse grouped-GEMM experts
  (:mod:`graphdsl.runtime.kernels.moe`), ``quant_moe_experts`` the same kernels over quantized
  stacks; ``quant_linear`` — the dequantize-in-GEMV/GEMM kernel
  (:mod:`graphdsl.runtime.kernels.quant_linear`; ``torch._scaled_mm`` for fp8 W8A8 prefill on
  Hopper); ``embedding`` — one gather launch into the node's slot (:mod:`graphdsl.runtime.kernels.embedding`);
  ``topk`` along the last dim of rows up to 4096 long — one launch writing both outputs
  (:mod:`graphdsl.runtime.kernels.row_topk`; the MoE routing). On CPU without ``TRITON_INTERPRET=1`` these run their torch references instead;
* matmuls of weights ``[N, K]`` (``transpose_b``) by at most 16 fp16/bf16 rows — the decode GEMV
  (:mod:`graphdsl.runtime.kernels.gemv`), bias, residual or SwiGLU (``matmul_silu_mul``) in its
  epilogue; ``matmul_silu_mul`` at the row counts where it beats cuBLAS (64, 128; 256 with K ≤
  2048) — a tiled GEMM with the SwiGLU in its epilogue (:mod:`graphdsl.runtime.kernels.swiglu_gemm`);
  other matmuls — ``torch.matmul(..., out=slot)`` / ``torch.addmm`` (cuBLAS on CUDA, its epilogue
  adds the bias or residual); ``matmul_silu_mul`` then runs ``silu_mul`` on the product, which it
  keeps in the node's planned workspace; the LoRA projections (``matmul_lora``, ``matmul_add_lora``,
  ``matmul_silu_mul_lora``) add the adapter term inside the same GEMV after one shrink launch, or
  through one more cuBLAS ``addmm`` for many rows (:func:`_lora_matmul`);
* collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``) on CUDA — NCCL through
  ``torch.distributed`` straight into the node's slot, or small all-reduces in one Triton launch
  over peer-mapped buffers (:mod:`graphdsl.runtime.distributed.collectives`), which also runs the
  ``add_rms_norm`` after one (:mod:`.allreduce_norm`), or, with ``GRAPHDSL_TP_CARRY=1``, leaves
  both to the decode GEMVs around them (:mod:`.tp_carry`);
* anything else — the op's torch reference, copied into its slot (views alias their source).

Kernels are prepared once per node and operand signature (shapes, strides, dtypes) and cached.
On Hopper the Triton kernels launch with programmatic dependent launch
(:mod:`graphdsl.runtime.kernels.pdl`), so each one's launch overlaps the tail of the one before.
On CPU the same kernels run under ``TRITON_INTERPRET=1`` (how CI tests them).
"""
from __future__ import annotations

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.functional.attention import RopeLayout
from graphdsl.network import Node
from graphdsl.opdef import OpCategory, Spec, get_op

from ..device import triton_interprets
from ..distributed.collectives import COLLECTIVE_LOWERINGS
from ..gguf_scheme import GGUFMixScheme, GGUFScheme

__all__ = ["TritonBackend", "triton_can_fuse"]


def _dry_pass() -> bool:
    """Inside a first forward's dry pass (:mod:`..precompile`), which records the Triton kernels
    it reaches: cuBLAS products are skipped too (their outputs read as the zeroed arena), so a warm
    start does not pay a prefill's GEMMs twice."""
    from ..precompile import dry_pass_running
    return dry_pass_running()


def triton_can_fuse(node: Node) -> str | None:
    """Narrow generic fusion to what the generated kernels compute."""
    from graphdsl.functional import scalar
    from graphdsl.passes.generic_fusion import default_can_fuse

    from ..codegen.fused import MAX_ROW
    from ..codegen.lowering import POINTWISE, POW_EXPONENTS, ROW_REDUCTIONS, TL_DTYPES
    reason = default_can_fuse(node)
    if reason is not None:
        return reason
    for t in list(node.inputs) + list(node.outputs):
        if t.dtype not in TL_DTYPES:
            return f"dtype: {t.dtype} has no Triton type here"
    if node.category is OpCategory.REDUCTION:
        if node.op not in ROW_REDUCTIONS:
            return f"no generated lowering for reduction '{node.op}' (have {list(ROW_REDUCTIONS)})"
        last = node.inputs[0].shape[-1]
        if isinstance(last, int) and last > MAX_ROW:
            return f"shape: row of {last} exceeds the {MAX_ROW} a row kernel holds"
        if node.op in ("sum", "max", "mean") and not node.outputs[0].dtype.is_floating_point:
            return f"dtype: integer {node.op} is not generated"
        return None
    if node.op not in POINTWISE:
        return f"no generated lowering for pointwise op '{node.op}'"
    if node.op == "pow":
        e = node.inputs[1].producer
        if e is None or e.opdef is not scalar.opdef or e.attrs.get("value") not in POW_EXPONENTS:
            return f"pow: only constant exponents {list(POW_EXPONENTS)} are generated"
    return None


class TritonBackend:
    name = "triton"

    def __init__(self):
        self._prepared: dict = {}
        self._workspaces: dict = {}             # (device, shapes) -> split-K decode partial buffers
        self._alibi: dict = {}                  # (device, slopes) -> ALiBi slopes as a device tensor
        self._single: dict = {}                 # node -> generated as a one-op kernel?
        self.sources: dict[str, str] = {}       # node name -> generated kernel source (for dumps)
        self._gemv_workspace = None             # split-K partials + counters of the decode GEMVs
        self._run_nodes: list = []              # the node list of the current run (step_constant)
        self._storage: dict = {}                # the current run's arena views (tensor / node -> view)
        self._values: dict = {}                 # the current run's tensor values (graph tensor -> torch tensor)
        self._planes_ready: dict = {}           # GGUF node -> its rows' A operand, made by the kernel before it
        self._gguf_next: tuple = (None, {})     # (a node list, norm node -> its GGUF readers right after it)
        self._step_view = None                  # (a node list, its set, graph input -> in-place writers)
        from .allreduce_norm import AllReduceNorm
        from .gather_carry import GatherCarry
        from .norm_carry import NormCarry
        from .torch_backend import TorchBackend
        from .tp_carry import TPCarry
        self._reference = TorchBackend()
        self.norms = NormCarry()                # RMSNorms carried by the decode GEMVs around them
        self.gathers = GatherCarry()            # act-order gathers carried by the int4 GEMV reading them
        self.gather_rows = None                 # the running node's carried gather (gather_carry.Pending)
        self.reduce_norms = AllReduceNorm()     # tensor-parallel all-reduces that also add and normalise
        self.tp_carry = TPCarry()               # tensor-parallel all-reduces + norms carried by the GEMVs around them

    # -- build time ----------------------------------------------------------------------------
    can_fuse = staticmethod(triton_can_fuse)

    def launches(self, net_or_nodes) -> int:
        """Kernel launches per forward: one per node except views."""
        nodes = getattr(net_or_nodes, "nodes", net_or_nodes)
        return sum(1 for n in nodes if n.category is not OpCategory.VIEW)

    # -- run -----------------------------------------------------------------------------------
    def run(self, nodes, values: dict, attrs: dict, storage: dict, after=None) -> None:
        """Execute ``nodes`` in order (arguments as :meth:`TorchBackend.run`); ``after(node, values)``,
        when given, runs after each node (taps copy there, profiles record events there)."""
        self._run_nodes = nodes
        self._storage = storage
        self._values = values
        self._planes_ready = {}
        self.norms.start(nodes, enabled=after is None)   # a hook reads every node's output: none carried
        self.gathers.start(nodes, enabled=after is None)
        self.reduce_norms.start(nodes, enabled=after is None)
        self.tp_carry.start(nodes, after is None)
        for node in nodes:
            self._run_one(node, values, attrs, storage)
            if after is not None:
                after(node, values)

    def ahead_applies(self, nodes, device) -> bool:
        """Whether a first forward of ``nodes`` on ``device`` runs watched, its missing Triton kernels
        compiled ahead (:func:`graphdsl.runtime.precompile.run_ahead`): where
        :func:`~graphdsl.runtime.precompile.applies`, for graphs without collectives (their kernels
        wait on the other ranks, whose launches a dry part skips)."""
        from .. import precompile
        return precompile.applies(device) and not any(n.category is OpCategory.COLLECTIVE for n in nodes)

    def _run_one(self, node, values: dict, attrs: dict, storage: dict) -> None:
        ins = [values[t] for t in node.inputs]
        on_cpu = bool(ins) and ins[0].device.type == "cpu" and not triton_interprets()
        if node.op == "gather" and self.gathers.defer(node, values, storage):
            return
        rows = self.gathers.take(node)          # this node's rows are a gather not yet made
        if rows is not None and (on_cpu or not _gemv_reads_rows(node, ins, attrs[node])
                                 or self._writes_over(node, rows.x, storage)):
            self.gathers.make(rows)
            rows = None
        self.gather_rows = rows
        try:
            self._lower(node, ins, on_cpu, values, attrs, storage)
        finally:
            self.gather_rows = None

    @staticmethod
    def _writes_over(node, x: torch.Tensor, storage: dict) -> bool:
        """Whether ``node`` writes memory that ``x`` spans: a GEMV reading ``x`` itself must not write
        there while other programs still read it (the planner keeps a gather's rows alive through its
        reader, ``passes.memory_plan``; an engine planned otherwise makes the gather instead). A
        carried norm's sum is kept off ``x`` by :mod:`.norm_carry` itself."""
        from .norm_carry import overlaps
        return any(storage.get(t) is not None and overlaps(storage[t], x) for t in node.outputs)

    def _lower(self, node, ins, on_cpu: bool, values: dict, attrs: dict, storage: dict) -> None:
        if self.tp_carry.done(node):            # an all-reduce or norm the GEMVs around it carry
            return
        if node.category is OpCategory.COLLECTIVE and not on_cpu and node.op in COLLECTIVE_LOWERINGS:
            if node.op == "all_reduce" and self.reduce_norms.launch(self, node, ins, values, attrs, storage):
                return
            dsts = [self._dst(t, storage, node, attrs[node], ins, i) for i, t in enumerate(node.outputs)]
            for t, r in zip(node.outputs, COLLECTIVE_LOWERINGS[node.op](self, node, ins, attrs[node], dsts)):
                values[t] = r
            return
        if node.op in _KERNEL_OPS and (on_cpu or _kernel_unsupported(node, ins)):
            _not_carried(self, node)
            self._reference.run([node], values, attrs, storage)
            return
        if on_cpu and (node.op in _LOWERINGS or self._lone_fusable(node)):
            raise GraphDSLError(f"backend 'triton' runs on CUDA, or on CPU with TRITON_INTERPRET=1; node "
                                f"'{node.name}' ({node.op}) got CPU tensors (use backend='torch' on CPU)")
        if self.reduce_norms.done(node) or self.norms.norm(node, values) \
                or self.norms.producer(self, node, values, attrs, storage) \
                or self.tp_carry.producer(self, node, values, attrs, storage):
            return
        lower = _LOWERINGS.get(node.op)
        if lower is None and node.category is OpCategory.MATMUL:
            lower = _matmul
        if lower is None and self._lone_fusable(node):
            lower = _single
        if lower is None:
            self._reference.run([node], values, attrs, storage)
            return
        dsts = [self._dst(t, storage, node, attrs[node], ins, i) for i, t in enumerate(node.outputs)]
        outs = lower(self, node, ins, attrs[node], dsts)
        for t, r in zip(node.outputs, outs):
            values[t] = r

    def step_constant(self, t) -> bool:
        """Whether tensor ``t`` is written by none of the nodes this backend runs: a graph input (bound
        weight or step input, copied in before the step) that no node updates in place, or a
        constant folded from weights once. Kernels may read such tensors before their PDL wait."""
        members, written = self._step()
        if t.producer is None:
            return t not in written
        return t.producer not in members

    def written_only_by(self, t, node) -> bool:
        """Whether graph input ``t`` is updated in place by ``node`` alone among this run's nodes (a
        layer's KV cache under its fused attention), so kernels before ``node`` leave it as it was."""
        return t.producer is None and self._step()[1].get(t, []) == [node]

    def _step(self) -> tuple[set, dict]:
        """The current run's node set and in-place writers per graph input, made when first asked
        and kept while the engine runs the same node list (held, so its identity stays unique)."""
        nodes, view = self._run_nodes, self._step_view
        if view is None or view[0] is not nodes or len(view[1]) != len(nodes):
            written: dict = {}
            for n in nodes:
                for i in n.opdef.inplace.values():
                    written.setdefault(n.inputs[i], []).append(n)
            view = self._step_view = (nodes, set(nodes), written)
        return view[1], view[2]

    def gguf_readers_next(self, node) -> list:
        """The GGUF ``quant_linear`` nodes right after ``node`` in this run (views aside) that read
        its first output, or a view of it (the attention's heads reshaped into one row), as their
        rows; found once per node list."""
        nodes, found = self._gguf_next
        if nodes is not self._run_nodes:
            found = {}
            self._gguf_next = (self._run_nodes, found)
        hit = found.get(node)
        if hit is None:
            from graphdsl.quant import parse_scheme
            readers, rows = _next_readers(self._run_nodes, node, node.outputs[0])
            hit = found[node] = [r for r in readers
                                 if r.op in ("quant_linear", "quant_linear_silu_mul") and r.inputs[0] in rows
                                 and isinstance(parse_scheme(r.attrs["scheme"]), (GGUFScheme, GGUFMixScheme))]
        return hit

    def workspace(self, node, ins, attrs) -> torch.Tensor:
        """``node``'s scratch, shaped by its op's workspace rule: the arena view the engine planned for
        it, or a fresh tensor when the caller planned none (a backend driven without an engine)."""
        spec = node.opdef.workspace_spec([Spec(tuple(x.shape), x.dtype) for x in ins], attrs)
        w = self._storage.get(node)
        if w is None:
            return torch.empty(spec.shape, dtype=spec.dtype, device=ins[0].device)
        if tuple(w.shape) != tuple(spec.shape) or w.dtype != spec.dtype:
            raise GraphDSLError(f"node '{node.name}' ({node.op}): its planned workspace is {list(w.shape)} {w.dtype}, "
                                f"the op's workspace rule gives {list(spec.shape)} {spec.dtype}")
        return w

    @property
    def gemv_workspace(self):
        """The split-K scratch of this backend's decode GEMVs (made on first use: importing the
        kernel module decides, once, whether its kernels run under the CPU interpreter)."""
        if self._gemv_workspace is None:
            from ..kernels.gemv import GemvWorkspace
            self._gemv_workspace = GemvWorkspace()
        return self._gemv_workspace

    def _lone_fusable(self, node) -> bool:
        ok = self._single.get(node)
        if ok is None:
            from graphdsl.functional import scalar
            ok = self._single[node] = (node.category in (OpCategory.POINTWISE, OpCategory.REDUCTION)
                                       and node.opdef is not scalar.opdef and triton_can_fuse(node) is None)
        return ok

    def _dst(self, t, storage, node, attrs, ins, i):
        d = storage.get(t)
        if d is not None or i in node.opdef.inplace:
            return d
        specs = node.opdef.infer([Spec(tuple(x.shape), x.dtype) for x in ins], attrs)
        return torch.empty(specs[i].shape, dtype=specs[i].dtype, device=ins[0].device)

    def _kernel(self, node, program, outputs, ins, dsts, own_inputs: bool = True):
        """The generated kernel of ``program`` over ``ins``. ``own_inputs``: ``ins`` are the values of
        ``node.inputs`` in order, so those the step never writes are read before the PDL wait."""
        key = (node, program, tuple((tuple(x.shape), x.stride(), x.dtype) for x in list(ins) + list(dsts)))
        hit = self._prepared.get(key)
        if hit is None:
            from ..codegen.fused import prepare_fused
            early = [i for i, t in enumerate(node.inputs) if self.step_constant(t)] if own_inputs else []
            hit = self._prepared[key] = prepare_fused(program, outputs, ins, dsts, early)
            self.sources[node.name] = hit[0].source
        return hit


_TRITON_EMBEDDING = True   # False: the torch reference (index_select, then a copy into the slot; decode_ab's A/B)


def _flat_ids(ids: torch.Tensor) -> torch.Tensor | None:
    return ids.reshape(-1) if ids.is_contiguous() else None


def _embedding_unsupported(ids: torch.Tensor, table: torch.Tensor) -> str | None:
    from ..kernels.embedding import embedding_supported
    if not _TRITON_EMBEDDING:
        return "turned off (_TRITON_EMBEDDING)"
    flat = _flat_ids(ids)
    return "ids are not contiguous" if flat is None else embedding_supported(flat, table)


def _embedding(be: TritonBackend, node, ins, attrs, dsts):
    """``embedding``: one gather launch straight into the node's slot (:mod:`..kernels.embedding`)."""
    from ..kernels.embedding import embedding
    ids, table = ins
    dst = dsts[0]
    if dst.is_contiguous():
        embedding(_flat_ids(ids), table, dst.view(-1, dst.shape[-1]))
    else:
        dst.copy_(embedding(_flat_ids(ids), table))
    return [dst]


def _topk(be: TritonBackend, node, ins, attrs, dsts):
    """``topk`` along the last dim: one launch writing both outputs into their slots
    (:mod:`..kernels.row_topk`); outputs in other layouts are written through a copy."""
    from ..kernels.row_topk import row_topk
    values, indices = dsts
    if values.is_contiguous() and indices.is_contiguous():
        row_topk(ins[0], node.attrs["k"], values, indices)
    else:
        got = row_topk(ins[0], node.attrs["k"])
        values.copy_(got[0])
        indices.copy_(got[1])
    return [values, indices]


def _index_mask(be: TritonBackend, node, ins, attrs, dsts):
    """``index_mask``: one launch (:func:`..kernels.row_topk.index_mask`)."""
    from ..kernels.row_topk import index_mask
    out = dsts[0]
    if out.is_contiguous():
        index_mask(ins[0], node.attrs["size"], out)
    else:
        out.copy_(index_mask(ins[0], node.attrs["size"]))
    return dsts


def _single(be: TritonBackend, node, ins, attrs, dsts):
    n = len(ins)
    program = ((node.op, tuple(range(n)), tuple(sorted(attrs.items()))),)
    k, data = be._kernel(node, program, (n,), ins, dsts)
    k([ins[r] for r in data], dsts)
    return dsts


def _fused(be: TritonBackend, node, ins, attrs, dsts):
    k, data = be._kernel(node, attrs["program"], attrs["outputs"], ins, dsts)
    k([ins[r] for r in data], dsts)
    return dsts


_NORM_PLANES = True   # a one-row add_rms_norm before Q4_K tensor-core GEMVs also makes their A operand
_SWIGLU_PLANES = True  # ... and a one-row GGUF gate/up GEMV's SwiGLU epilogue before them (down)
_SWIGLU_PLANES_Q6K = True  # ... also in the Q6_K GEMV's format, for a Q6_K down on the tensor cores
_NORM_ROWS_PLANES = True  # an add_rms_norm before GGUF GEMVs on the rows kernel makes their operands (quant.py's A/B)


def _add_rms_norm(be: TritonBackend, node, ins, attrs, dsts):
    if _NORM_PLANES and _norm_planes(be, node, ins, attrs, dsts):
        return dsts
    from ..codegen.ops import add_rms_norm_program
    k, data = be._kernel(node, add_rms_norm_program(attrs["eps"]), (4, 3), ins, dsts)
    k([ins[r] for r in data], dsts)
    return dsts


def _norm_planes(be: TritonBackend, node, ins, attrs, dsts) -> bool:
    """An ``add_rms_norm`` read next by GGUF projections that run on the tensor cores: for one row
    whose Q4_K parts do, :func:`..kernels.gguf_mma.norm_planes` writes the normed row, the sum and
    their A operand in one launch; for 1..32 rows whose parts run the rows kernel (one row: Q5_K's),
    :func:`..kernels.gguf_mma_rows.norm_rows_planes` writes the rows' operands (shared by every
    part: Q4_K, Q5_K and Q6_K read one format). Those projections skip their activation launch.
    The readers must be the nodes right after the norm (views aside), so no other tensor-core GEMV
    rewrites the operand buffer in between; a reader that does not take it reads the normed row
    as before. The outputs must not share memory with the inputs: every program reads a whole row."""
    from ..kernels.gguf_mma import norm_planes
    from ..kernels.gguf_mma_rows import MMA_ROWS, norm_rows_planes
    from .norm_carry import overlaps
    readers = be.gguf_readers_next(node)
    if not readers:
        return False
    x, res, w = ins
    out, s = dsts
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if not 1 <= m <= MMA_ROWS or not all(t.shape == (m, k) and t.is_contiguous() for t in (x, res, out, s)) \
            or k % 256 or x.dtype not in (torch.float16, torch.bfloat16) or not w.is_contiguous() \
            or {t.dtype for t in (x, res, w, out, s)} != {x.dtype} \
            or not (x.device.type == "cuda" or triton_interprets()):
        return False
    if any(overlaps(o, i) for o in (out, s) for i in (x, res)):     # each program reads a whole row first
        return False
    one_row = _planes_takers(be, readers, out) if m == 1 else []       # parts on Q4_K's one-row kernel
    takers = one_row or (_planes_takers(be, readers, out, "rows") if _NORM_ROWS_PLANES else [])   # the rows kernel
    if not takers:
        return False
    if one_row:
        planes = norm_planes(x, res, w, attrs["eps"], out, s, be.gemv_workspace.planes(x.device, k))
    else:
        planes = norm_rows_planes(x, res, w, attrs["eps"], out, s, be.gemv_workspace.rows_planes(x.device, k))
    be._planes_ready.update(dict.fromkeys(takers, planes))
    return True


def _planes_takers(be: TritonBackend, readers, rows: torch.Tensor, fmt: str = "Q4_K") -> list:
    """The GGUF projections among ``readers`` that run a ``fmt`` (Q4_K, or Q6_K) row part of theirs
    on the one-row tensor-core GEMV for ``rows`` (``[1, K]``), or with ``fmt`` "rows" any part on the
    rows kernel (:func:`..kernels.gguf_linear.on_rows_kernel`): those that read an A operand made for
    them in that format."""
    from graphdsl.quant import parse_scheme

    from ..kernels.gguf_linear import mma_eligible, on_rows_kernel
    takers = []
    for reader in readers:
        scheme = parse_scheme(reader.attrs["scheme"])
        parts = zip([be._values[t] for t in reader.inputs[1:]], scheme.row_parts(reader.attrs["out_features"]))
        if any(on_rows_kernel(rows, data, qtype) if fmt == "rows" else
               qtype == fmt and mma_eligible(rows, data, qtype) and not on_rows_kernel(rows, data, qtype)
               for data, (qtype, _, _) in parts):
            takers.append(reader)
    return takers


def _swiglu_planes(be: TritonBackend, node, out: torch.Tensor):
    """For a one-row GGUF gate/up GEMV with SwiGLU whose output is read next by Q4_K (else Q6_K)
    projections on the tensor cores (``down``): the A operand buffers, in that type's format, its
    epilogue also fills (:func:`..kernels.gguf_mma.gguf_gemv_mma`'s ``planes_out``), marked ready
    for those readers; else None. As for :func:`_norm_planes`, the readers must be the nodes right
    after it."""
    from ..kernels.gguf_mma import swiglu_planes_possible
    if not _SWIGLU_PLANES or out.shape[0] != 1 or not swiglu_planes_possible(out.shape[-1]):
        return None
    readers = be.gguf_readers_next(node)
    takers = _planes_takers(be, readers, out)
    planes = be.gemv_workspace.planes(out.device, out.shape[-1]) if takers else None
    if not takers and _SWIGLU_PLANES_Q6K:
        takers = _planes_takers(be, readers, out, "Q6_K")
        planes = be.gemv_workspace.q6k_planes(out.device, out.shape[-1]) if takers else None
    if not takers:
        return None
    be._planes_ready.update(dict.fromkeys(takers, planes))
    return planes


def _planes_for(planes, x: torch.Tensor, data: torch.Tensor, qtype: str):
    """``planes`` if they are what ``qtype``'s tensor-core GEMV of the rows ``x`` reads (one row: three
    buffers for Q4_K, two for Q6_K; on the rows kernel: the rows' operands, any type)."""
    from ..kernels.gguf_linear import on_rows_kernel
    from ..kernels.gguf_mma_rows import is_rows_planes
    if planes is None:
        return None
    if is_rows_planes(planes):
        return planes if on_rows_kernel(x, data, qtype) else None
    if x.shape[0] == 1 and (qtype, len(planes)) in (("Q4_K", 3), ("Q6_K", 2)) and not on_rows_kernel(x, data, qtype):
        return planes
    return None


def _next_readers(nodes, node, output) -> tuple[list, set]:
    """The nodes right after ``node`` in ``nodes`` that read one of its outputs or a view of one, up
    to the first node (other than a view) that does not; and ``output`` (one of them) with its views."""
    live, rows, found = set(node.outputs), {output}, []
    for n in nodes[nodes.index(node) + 1:]:
        if any(t in live for t in n.inputs):
            found.append(n)
            if n.category is OpCategory.VIEW:
                live.update(n.outputs)
                if any(t in rows for t in n.inputs):
                    rows.update(n.outputs)
        elif n.category is not OpCategory.VIEW:
            break
    return found, rows


def _silu_mul(be: TritonBackend, node, ins, attrs, dsts):
    from ..codegen.ops import SILU_MUL_PROGRAM
    x = ins[0]
    half = x.shape[-1] // 2
    halves = [x[..., :half], x[..., half:]]
    k, data = be._kernel(node, SILU_MUL_PROGRAM, (3,), halves, dsts, own_inputs=False)
    k([halves[r] for r in data], dsts)
    return dsts


def _rope_cache(be: TritonBackend, node, ins, attrs, dsts):
    from ..codegen.rope_cache import prepare_rope_cache
    operands = list(ins) + [dsts[0]]
    key = (node, attrs["layout"], tuple((tuple(x.shape), x.stride(), x.dtype) for x in operands))
    kernel = be._prepared.get(key)
    if kernel is None:
        kernel = be._prepared[key] = prepare_rope_cache(*operands, attrs["layout"])
    kernel(*operands)
    return [dsts[0], ins[3], ins[4]]


def _rope(be: TritonBackend, node, ins, attrs, dsts):
    """``rope`` not fused with a cache write (MLA's ``q_pe``, ``k_pe``): one launch, or the torch
    reference for operands the kernel does not take (:func:`~..kernels.rope.rope_unsupported`)."""
    from ..kernels.rope import rope, rope_unsupported
    q, k, cos, sin = ins
    if rope_unsupported(q, k, cos, sin, *dsts) is not None:
        be._reference.run([node], be._values, {node: attrs}, be._storage)
        return [be._values[t] for t in node.outputs]
    return list(rope(q, k, cos, sin, *dsts, layout=attrs.get("layout", RopeLayout.NEOX)))


def _cat(be: TritonBackend, node, ins, attrs, dsts):
    """``cat`` straight into its slot (``torch.cat(out=)``, one launch): the reference's result was
    copied there, a second launch (MLA's two cats a layer)."""
    torch.cat(ins, dim=attrs.get("dim", 0), out=dsts[0])      # one dtype (the op's shape rule)
    return [dsts[0]]


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _attention_unsupported(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None) -> str | None:
    dim = q.shape[-1]
    if dim < 16 or dim > 256 or dim & (dim - 1):
        return f"head_dim {dim} is not a power of two in [16, 256]"
    if q.dtype not in _KERNEL_DTYPES or key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        return f"dtypes q {q.dtype}, caches {key_cache.dtype}/{value_cache.dtype}"
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1 or block_tables.stride(-1) != 1 \
            or not seq_lens.is_contiguous() or (query_start_loc is not None and not query_start_loc.is_contiguous()):
        return "non-unit inner strides"
    return None


def _mla_unsupported(q, key_cache, value_cache, block_tables, seq_lens, *qsl, value_dim) -> str | None:
    rope = q.shape[-1] - value_dim
    if not all(n >= 16 and n & (n - 1) == 0 for n in (value_dim, rope)) or rope > value_dim:
        return f"latent {value_dim} + {rope} is not two powers of two >= 16 with the RoPE part the smaller"
    if q.dtype not in _KERNEL_DTYPES or key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        return f"dtypes q {q.dtype}, caches {key_cache.dtype}/{value_cache.dtype}"
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1 or block_tables.stride(-1) != 1 \
            or not seq_lens.is_contiguous() or not all(x.is_contiguous() for x in qsl):
        return "non-unit inner strides"
    return None


def _kernel_unsupported(node, ins) -> str | None:
    """Why the hand-written kernel cannot take this call (then the op's torch reference runs)."""
    if node.op == "paged_attention":
        return _attention_unsupported(*ins)
    if node.op == "paged_mla_attention":
        return _mla_unsupported(*ins, value_dim=node.attrs["value_dim"])
    if node.op in _QUANT_OPS:
        from graphdsl.quant import parse_scheme

        from ..kernels.quant_linear import quant_linear_supported
        x = ins[0]
        if x.dim() < 1 or not x.is_contiguous():
            return "x is not contiguous"
        if node.op == "quant_linear_add" and (ins[1].dtype != x.dtype or ins[1].stride(-1) != 1):
            return f"addend {ins[1].dtype} strides {ins[1].stride()}"
        stored = list(ins[2:] if node.op == "quant_linear_add" else ins[1:])
        scheme = parse_scheme(node.attrs["scheme"])
        if isinstance(scheme, (GGUFScheme, GGUFMixScheme)):
            return _gguf_unsupported(x, stored)
        return quant_linear_supported(x.reshape(-1, x.shape[-1]), scheme, stored)
    if node.op == "embedding":
        return _embedding_unsupported(*ins)
    if node.op == "index_mask":
        from ..kernels.row_topk import index_mask_supported
        return index_mask_supported(ins[0], node.attrs["size"])
    if node.op == "topk":
        from ..kernels.row_topk import row_topk_supported
        x = ins[0]
        if node.attrs["dim"] not in (-1, x.dim() - 1):
            return f"dim {node.attrs['dim']} (the last only)"
        return row_topk_supported(x, node.attrs["k"])
    if node.op == "moe_experts":
        from ..kernels.moe import moe_supported
        return moe_supported(*ins)
    if node.op == "quant_moe_experts":
        from ..kernels.moe import quant_moe_supported
        schemes, stacks = _quant_moe_operands(node, ins)
        return quant_moe_supported(ins[0], ins[1], schemes, stacks)
    if node.op == "lora_apply":
        from ..kernels.lora import lora_supported
        return lora_supported(*ins)
    if node.op == "rope_cache_attention":
        q, k, v, key_cache, value_cache, cos, sin, slot_mapping, block_tables, seq_lens = ins
        if k.dtype not in _KERNEL_DTYPES or v.dtype not in _KERNEL_DTYPES:
            return f"dtypes k {k.dtype}, v {v.dtype}"
        if cos.stride(-1) != 1 or sin.stride() != cos.stride() or not slot_mapping.is_contiguous():
            return "cos/sin strides differ or slot_mapping is not contiguous"
        return _attention_unsupported(q, key_cache, value_cache, block_tables, seq_lens)
    key_cache, value_cache = ins[2], ins[3]
    if key_cache.dtype not in _KERNEL_DTYPES or value_cache.dtype not in _KERNEL_DTYPES \
            or ins[0].dtype not in _KERNEL_DTYPES or ins[1].dtype not in _KERNEL_DTYPES:
        return "dtypes"
    if not (key_cache.is_contiguous() and value_cache.is_contiguous() and ins[4].is_contiguous()):
        return "non-contiguous caches or slot_mapping"
    return None


def _decode_workspace(be: TritonBackend, q, key_cache, block_tables, sliding_window):
    """Split count and the backend's kept split scratch for a decode of these operands."""
    from ..kernels.paged_attention import decode_num_splits, decode_workspace
    num_seqs, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    splits = decode_num_splits(num_seqs, kv_heads, block_tables.shape[1], key_cache.shape[1], sliding_window,
                               q.device)
    if splits == 1 or num_seqs == 0:
        return splits, None
    key = (q.device, num_seqs, heads, kv_heads, dim, splits)
    workspace = be._workspaces.get(key)
    if workspace is None:
        workspace = be._workspaces[key] = decode_workspace(num_seqs, heads, kv_heads, dim, splits, q.device)
    return splits, workspace


def _alibi_slopes(be: TritonBackend, slopes: tuple, device) -> torch.Tensor | None:
    """The node's ``alibi_slopes`` attribute as a float32 device tensor, made once (a CUDA-graph
    replay must find it at the same address)."""
    if not slopes:
        return None
    key = (device, slopes)
    t = be._alibi.get(key)
    if t is None:
        t = be._alibi[key] = torch.tensor(slopes, dtype=torch.float32, device=device)
    return t


def _paged_attention(be: TritonBackend, node, ins, attrs, dsts):
    from ..kernels.paged_attention import paged_attention_decode, paged_attention_prefill
    q, key_cache, value_cache, block_tables, seq_lens = ins[:5]
    if q.stride(-1) != 1:
        q = q.contiguous()
    common = dict(scale=attrs["scale"], sliding_window=attrs["sliding_window"], soft_cap=attrs["soft_cap"],
                  out=dsts[0], alibi_slopes=_alibi_slopes(be, attrs["alibi_slopes"], q.device))
    if len(ins) == 6:
        paged_attention_prefill(q, key_cache, value_cache, block_tables, seq_lens, ins[5], **common)
        return dsts
    splits, workspace = _decode_workspace(be, q, key_cache, block_tables, attrs["sliding_window"])
    paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, num_splits=splits,
                           workspace=workspace, inputs_ready=all(be.step_constant(node.inputs[i]) for i in (3, 4)),
                           planes=_attention_planes(be, node, dsts[0]), **common)
    return dsts


def _paged_mla_attention(be: TritonBackend, node, ins, attrs, dsts):
    from ..kernels.paged_mla_attention import mla_num_splits, mla_workspace, paged_mla_attention
    q, key_cache, value_cache, block_tables, seq_lens = ins[:5]
    qsl = ins[5] if len(ins) == 6 else None
    if q.stride(-1) != 1:
        q = q.contiguous()
    tokens, heads, lora = q.shape[0], q.shape[1], attrs["value_dim"]
    splits = mla_num_splits(tokens, heads, block_tables.shape[1], key_cache.shape[1], q.device,
                            prefill=qsl is not None)
    workspace = None
    if splits > 1:
        key = ("mla", q.device, tokens, heads, lora, splits)
        workspace = be._workspaces.get(key)
        if workspace is None:
            workspace = be._workspaces[key] = mla_workspace(tokens, heads, lora, splits, q.device)
    paged_mla_attention(q, key_cache, value_cache, block_tables, seq_lens, qsl, scale=attrs["scale"],
                        value_dim=lora, out=dsts[0], num_splits=splits, workspace=workspace)
    return dsts


def _rope_cache_attention(be: TritonBackend, node, ins, attrs, dsts):
    from ..kernels.paged_attention import DecodeRopeCache, paged_attention_decode
    q, k, v, key_cache, value_cache, cos, sin, slot_mapping, block_tables, seq_lens = ins
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    splits, workspace = _decode_workspace(be, q, key_cache, block_tables, attrs["sliding_window"])
    paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale=attrs["scale"],
                           sliding_window=attrs["sliding_window"], soft_cap=attrs["soft_cap"], out=dsts[0],
                           num_splits=splits, workspace=workspace,
                           rope_cache=DecodeRopeCache(k, v, cos, sin, slot_mapping, attrs["layout"]),
                           inputs_ready=all(be.step_constant(node.inputs[i]) for i in (5, 6, 7, 8, 9)),
                           cache_ready=all(be.written_only_by(node.inputs[i], node) for i in (3, 4)),
                           planes=_attention_planes(be, node, dsts[0]))
    return [dsts[0], key_cache, value_cache]


_ATTENTION_PLANES = True   # a one-row decode attention before Q4_K tensor-core GEMVs (o) also makes their A operand


def _attention_planes(be: TritonBackend, node, out: torch.Tensor):
    """For one decode row whose attention output is read next (through views) by GGUF projections
    that run a Q4_K part on the tensor cores (``o_proj``): the A operand buffers the attention's
    epilogue also fills (``paged_attention_decode(..., planes=)``), marked ready for them; else
    None. As for :func:`_norm_planes`, the readers must be the nodes right after it."""
    from ..kernels.paged_attention import planes_possible
    if not _ATTENTION_PLANES or out.shape[0] != 1 or not out.is_contiguous() \
            or not planes_possible(out.shape[-2], out.shape[-1]):
        return None
    row = out.reshape(1, -1)
    takers = _planes_takers(be, be.gguf_readers_next(node), row)
    if not takers:
        return None
    planes = be.gemv_workspace.planes(out.device, row.shape[1])
    be._planes_ready.update(dict.fromkeys(takers, planes))
    return planes


def _reshape_and_cache(be: TritonBackend, node, ins, attrs, dsts):
    from ..kernels.cache_write import reshape_and_cache
    key, value, key_cache, value_cache, slot_mapping = ins
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return [key_cache, value_cache]


def _moe_experts(be: TritonBackend, node, ins, attrs, dsts):
    from graphdsl.functional import ActType

    from ..kernels.moe import moe_experts
    x, routing, gate_up, down = ins
    top_k = attrs["top_k"] or gate_up.shape[0]
    moe_experts(x, routing, gate_up, down, top_k=top_k, geglu=attrs["act"] is ActType.GEGLU, out=dsts[0])
    return dsts


def _quant_moe_operands(node, ins) -> tuple[tuple, tuple[list, list]]:
    """A ``quant_moe_experts`` node's ``(gate/up scheme, down scheme)`` and its two stacks'
    stored tensors (the inputs after ``x`` and ``routing``, gate/up's companions first)."""
    from graphdsl.functional.moe import split_stacks
    from graphdsl.quant import parse_scheme
    a = node.attrs
    *_, up, down = split_stacks(list(ins[2:]), a["gate_up_scheme"], a["down_scheme"], a["experts"], a["hidden"],
                                a["intermediate"])
    return (parse_scheme(a["gate_up_scheme"]), parse_scheme(a["down_scheme"])), (up, down)


def _quant_moe_experts(be: TritonBackend, node, ins, attrs, dsts):
    from graphdsl.functional import ActType

    from ..kernels.moe import quant_moe_experts
    schemes, (up, down) = _quant_moe_operands(node, ins)
    quant_moe_experts(ins[0], ins[1], up, down, schemes=schemes, top_k=attrs["top_k"] or attrs["experts"],
                      geglu=attrs["act"] is ActType.GEGLU, out=dsts[0])
    return dsts


def _gguf_unsupported(x: torch.Tensor, stored: list[torch.Tensor]) -> str | None:
    """Why :func:`~graphdsl.runtime.kernels.gguf_linear.gguf_linear` cannot take ``x`` and the blocks ``stored``."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x dtype {x.dtype}"
    if not all(t.is_contiguous() for t in stored):
        return "the packed blocks are not contiguous"
    return None


def _lora_apply(be: TritonBackend, node, ins, attrs, dsts):
    from ..kernels.lora import lora_apply
    lora_apply(*ins, out=dsts[0], workspace=be.workspace(node, ins, attrs), scratch=be._workspaces)
    return dsts


_XPACK_GATE_UP = True         # one int4 row of gate/up: its activation bytes made by one launch before the GEMV
_XPACK_MIN_WEIGHTS = 1 << 26  # ... for a weight of at least this many codes (8B gate_up: 117M; 1B's 34M lost)
_PARTS_BESIDE = True          # a mixed GGUF weight's CUDA-core row parts run beside its first part (_parts_beside)


def xpack_pays(silu: bool, codes: torch.Tensor) -> bool:
    """Whether one int4 row of a projection reads its activations packed (``gemv(..., xpack=)``):
    the gate/up GEMVs of at least ``_XPACK_MIN_WEIGHTS`` codes. On an H100 the Llama-3-8B gate/up
    GEMV went from 32.2 to 26.9 µs with the pack launch (wider tiles, two groups a step: 26.1 µs
    alone); the smaller projections, the 1B gate/up among them (10.0 -> 11.3 µs), lost
    (docs/quantization-log.md) — on the H200 also with the bytes stored by the producer of a carried
    norm instead of launched (:mod:`.norm_carry`): every int4 reader of such rows packed, 8B
    2156 -> 2202 µs a step, 1B 640 -> 708."""
    return silu and _XPACK_GATE_UP and codes.numel() * 2 >= _XPACK_MIN_WEIGHTS      # two int4 codes a byte


def _int4_xpack(be: TritonBackend, x: torch.Tensor, scheme, perm: torch.Tensor | None = None) -> torch.Tensor | None:
    """One int4 row's activations packed for the GEMV's integer-dot loop (:mod:`..kernels.int4_acts`)
    by a launch into the backend's buffer for its K, or None where the one-row loop does not apply.
    ``perm`` (act-order): the bytes of ``x[:, perm]``, gathered as they are read."""
    from ..kernels.gemv import W_INT4, W_INT4_ZP, weight_kind
    from ..kernels.int4_acts import pack_int4_activations
    k = x.shape[-1]
    if x.shape[0] != 1 or weight_kind(scheme) not in (W_INT4, W_INT4_ZP) or x.stride(-1) != 1:
        return None
    group = scheme.group_size
    if k % max(group, 128):                               # the one-row loop's steps (_pick_quant_config)
        return None
    key = ("int4_xpack", x.device, k)
    buf = be._workspaces.get(key)
    if buf is None:
        buf = be._workspaces[key] = torch.zeros(6, k // 8, dtype=torch.int32, device=x.device)
    return pack_int4_activations(x, group, out=buf, perm=perm)


def _gemv_reads_rows(node, ins, attrs) -> bool:
    """Whether ``node`` (a carried gather's reader) runs as a decode GEMV on these operands, which
    then reads its rows through the gather's index (``gemv(..., perm=)``; :mod:`.gather_carry`)."""
    from graphdsl.quant import parse_scheme

    from ..kernels.gemv import W_INT4, W_INT4_ZP, gemv_supported, weight_kind
    if node.op not in _QUANT_OPS or _kernel_unsupported(node, ins) is not None:
        return False
    scheme = parse_scheme(attrs["scheme"])
    codes = ins[2] if node.op == "quant_linear_add" else ins[1]
    x = ins[0]
    return weight_kind(scheme) in (W_INT4, W_INT4_ZP) and gemv_supported(x.reshape(-1, x.shape[-1]), codes, scheme)


def _quant_linear(be: TritonBackend, node, ins, attrs, dsts):
    """``quant_linear`` and its fused epilogues (``quant_linear_silu_mul``, ``quant_linear_add``):
    a few rows run the decode GEMV with the weight dequantized in registers and the epilogue in
    its last store (:mod:`graphdsl.runtime.kernels.gemv`); more rows the dequantize-in-GEMM kernel
    (:mod:`graphdsl.runtime.kernels.quant_linear`) — or, for fp8 with dynamic activation scales on
    Hopper, ``torch._scaled_mm`` (FP8 tensor cores, row-wise scales) on the rows quantized per
    token — into the node's workspace, then the epilogue. ``gguf-<type>`` schemes run
    :func:`~graphdsl.runtime.kernels.gguf_linear.gguf_linear` (GEMV on the blocks for a few rows,
    dequantize + cuBLAS for more; once per row part of a ``GGUFMixScheme``), then the same epilogues."""
    from graphdsl.quant import Fp8Scheme, parse_scheme, quantize_fp8_rows

    from ..kernels.gemv import gemv, gemv_supported
    from ..kernels.quant_linear import quant_linear
    scheme = parse_scheme(attrs["scheme"])
    add = ins[1] if node.op == "quant_linear_add" else None
    x, dst = ins[0], dsts[0]
    stored = list(ins[2:] if add is not None else ins[1:])
    x2, out2 = x.reshape(-1, x.shape[-1]), dst.view(-1, dst.shape[-1])
    n = attrs["out_features"]
    silu = node.op == "quant_linear_silu_mul"
    add2 = None if add is None else (add if add.dim() == 1 else add.reshape(-1, n))
    gguf = isinstance(scheme, (GGUFScheme, GGUFMixScheme))
    if gemv_supported(x2, stored[0], scheme) and (x2.device.type == "cuda" or triton_interprets()):
        rows, perm = be.gather_rows, None          # act-order: read x through the gather's index
        if rows is not None:
            x2, perm = rows.x.reshape(-1, rows.x.shape[-1]), rows.index
        xpack, tp_in = None, be.tp_carry.tp_in(node)    # (a carried all-reduce: the GEMV makes its rows)
        if xpack_pays(silu, stored[0]) and tp_in is None:   # the bytes stored by the producer, else a launch
            xpack = be.norms.xpack(node, scheme) if rows is None else None
            if xpack is None:
                xpack = _int4_xpack(be, x2, scheme, perm)
        gemv(x2, stored[0], add2, silu_mul=silu, out=out2, workspace=be.gemv_workspace, scheme=scheme,
             scales=stored[1], zeros=stored[2] if len(stored) > 2 else None, xpack=xpack,
             rms_in=be.norms.rms_in(node), perm=perm if xpack is None else None, tp_in=tp_in)
        return dsts
    if be.gather_rows is not None:                # (_gemv_reads_rows promised the GEMV: never, but safe)
        be.gathers.make(be.gather_rows)
    rms_in = be.norms.rms_in(node) if gguf else None   # a carried norm's factor: every GGUF GEMV part applies it
    if not gguf:
        _not_carried(be, node)
    planes = be._planes_ready.pop(node, None)   # made by the kernel before (_norm_planes, _swiglu_planes, a carry)
    if gguf and silu and len(stored) == 1:     # one GGUF type: SwiGLU in the tensor-core GEMV's epilogue
        from ..kernels.gguf_linear import SWIGLU_QTYPES, gguf_gemv, mma_eligible, on_rows_kernel
        (qtype, _, _), = scheme.row_parts(n)
        if qtype in SWIGLU_QTYPES and mma_eligible(x2, stored[0], qtype) and x2.stride(-1) == 1 \
                and out2.stride(-1) == 1:           # (the one-row kernel's epilogue also writes down's operand)
            gguf_gemv(x2, stored[0], qtype, silu_mul=True, out=out2, workspace=be.gemv_workspace,
                      planes=_planes_for(planes, x2, stored[0], qtype),
                      planes_out=None if on_rows_kernel(x2, stored[0], qtype) else _swiglu_planes(be, node, out2),
                      rms_in=rms_in)
            return dsts
    prod = be.workspace(node, ins, attrs).view(-1, n) if silu else out2
    if gguf:                                   # GGUF blocks: their kernel once per row part
        from ..kernels.gguf_linear import gemv_rows, gguf_gemv, gguf_linear
        parts = list(zip(stored, scheme.row_parts(n)))
        on_gemv = 1 <= x2.shape[0] <= min(gemv_rows(q) for _, (q, _, _) in parts) and x2.stride(-1) == 1 \
            and prod.stride(-1) == 1 and (add2 is None or (add2.dtype == x2.dtype and add2.stride(-1) == 1))
        if not on_gemv:
            _not_carried(be, node)
        beside = on_gemv and _parts_beside(x2, parts)
        for i, (data, (qtype, r0, r1)) in enumerate(parts):
            if on_gemv:                        # straight into the product's columns, the addend's slice added
                gguf_gemv(x2, data, qtype, None if add2 is None else add2[..., r0:r1], out=prod[:, r0:r1],
                          workspace=be.gemv_workspace, planes=_planes_for(planes, x2, data, qtype), rms_in=rms_in,
                          early_launch=beside and i == 0, beside=beside and i > 0)
            else:
                prod[:, r0:r1].copy_(gguf_linear(x2, data, qtype))
        if on_gemv:
            add2 = None
    elif isinstance(scheme, Fp8Scheme) and scheme.dynamic_activations and _scaled_mm_rows(x2, n):
        xq, sx = quantize_fp8_rows(x2)
        sw = stored[1].float().reshape(-1, 1).expand(n, 1).reshape(1, n)
        prod.copy_(torch._scaled_mm(xq, stored[0].t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype))
    else:
        quant_linear(x2, stored, scheme, n, out=prod)
    if silu:
        _silu_mul(be, node, [prod], attrs, [out2])
    elif add2 is not None:
        out2.add_(add2)
    return dsts


def _parts_beside(x: torch.Tensor, parts) -> bool:
    """Whether the row parts of a mixed-type GGUF weight run side by side (``gguf_gemv``'s
    ``early_launch`` / ``beside``): under PDL, the parts after the first on the CUDA cores. Each part
    reads the same input and writes its own columns, so none waits for another; in a Q4_K_M layer
    the Q6_K ``v`` rows then stream while the Q4_K ``q``/``k`` rows do, not after them
    (``_PARTS_BESIDE``)."""
    from ..kernels.gguf_linear import mma_eligible
    from ..kernels.pdl import pdl_available
    return (_PARTS_BESIDE and len(parts) > 1 and pdl_available(x.device)
            and not any(mma_eligible(x, data, qtype) for data, (qtype, _, _) in parts[1:]))


def _scaled_mm_rows(x: torch.Tensor, n: int) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales takes this prefill (Hopper, bf16, > 16 rows)."""
    return (x.device.type == "cuda" and x.shape[0] > 16 and x.dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and x.shape[1] % 16 == 0 and n % 16 == 0)


def _operands(ins, attrs):
    a, b = ins[0], ins[1]
    return (a.mT if attrs.get("transpose_a") else a), (b.mT if attrs.get("transpose_b") else b)


def _gemv_rows(x: torch.Tensor, w: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether the decode GEMV takes ``x @ w.T`` into ``dst`` (else cuBLAS does)."""
    from ..kernels.gemv import gemv_supported
    return (x.device.type == "cuda" or triton_interprets()) and dst.stride(-1) == 1 and gemv_supported(x, w)


def _not_carried(be: TritonBackend, node) -> None:
    """A projection leaving the decode GEMV must not have been promised a carried norm's scale."""
    if be.norms.rms_in(node) is not None:
        raise GraphDSLError(f"node '{node.name}' ({node.op}): its input's RMSNorm was left to its GEMV "
                            f"(runtime/backends/norm_carry.py), but it does not run as one")
    if be.tp_carry.tp_in(node) is not None:
        raise GraphDSLError(f"node '{node.name}' ({node.op}): its input's all-reduce and RMSNorm were left to its "
                            f"GEMV (runtime/backends/tp_carry.py), but it does not run as one")


def _matmul_silu_mul(be: TritonBackend, node, ins, attrs, a, b, dst) -> torch.Tensor:
    """The GEMV with its SwiGLU epilogue for up to 16 rows; the tiled GEMM with it at the row
    counts where it beats cuBLAS (:func:`..kernels.swiglu_gemm.launch_for`); otherwise the GEMM
    into the node's workspace, then the ``silu_mul`` kernel (its reference on plain CPU)."""
    if attrs.get("transpose_b") and not attrs.get("transpose_a"):
        from ..kernels.swiglu_gemm import launch_for, swiglu_gemm, swiglu_gemm_supported
        if _gemv_rows(ins[0], ins[1], dst):
            from ..kernels.gemv import gemv
            return gemv(ins[0], ins[1], silu_mul=True, out=dst, workspace=be.gemv_workspace,
                        rms_in=be.norms.rms_in(node), tp_in=be.tp_carry.tp_in(node))
        if swiglu_gemm_supported(ins[0], ins[1], dst) and launch_for(*ins[0].shape) is not None:
            return swiglu_gemm(ins[0], ins[1], out=dst)
    _not_carried(be, node)
    prod = be.workspace(node, ins, attrs)
    if not _dry_pass():
        torch.matmul(a, b, out=prod)
    if dst.device.type == "cpu" and not triton_interprets():
        return dst.copy_(get_op("silu_mul").reference(prod))
    return _silu_mul(be, node, [prod], attrs, [dst])[0]


_LORA_MATMULS = ("matmul_lora", "matmul_add_lora", "matmul_silu_mul_lora")


def _lora_matmul(be: TritonBackend, node, ins, attrs, dsts):
    """``matmul_lora`` / ``matmul_add_lora`` / ``matmul_silu_mul_lora`` (``x @ w.T`` + each row's LoRA
    term, then the epilogue). Up to 16 fp16/bf16 rows: the BGMV shrink into the node's workspace,
    then the decode GEMV adding the term to its float32 sums before the bias/residual or SwiGLU
    epilogue — one launch more than the base projection. More rows: the slot-dense shrink first
    (a Triton kernel right after the previous one, so PDL overlaps its launch), cuBLAS for the base
    product (``addmm`` with the addend, or into the workspace), then one cuBLAS ``addmm`` of
    ``V·B_allᵀ`` into the product — two launches more — or, for SwiGLU, :func:`silu_mul_lora`
    adding the term inside the ``silu_mul`` launch — one more.
    Few rows of another dtype (float32) take the BGMV shrink and expand in place instead. Plain CPU
    and operands the kernels do not take run the op's reference."""
    from graphdsl.passes.fused_ops import lora_workspace_layout

    from ..kernels.gemv import GemvLoRA, gemv, gemv_supported
    from ..kernels.lora import (MAX_BGMV_ROWS, lora_apply, lora_dense_view, lora_shrink, lora_shrink_dense,
                                lora_supported, silu_mul_lora)
    x, w, dst = ins[0], ins[1], dsts[0]
    add = ins[2] if node.op == "matmul_add_lora" else None
    a, b, idx = ins[-3:]
    silu = node.op == "matmul_silu_mul_lora"
    plain_cpu = x.device.type == "cpu" and not triton_interprets()
    if plain_cpu or x.dim() != 2 or dst.stride(-1) != 1 or lora_supported(x, x, a, b, idx) is not None \
            or (add is not None and (add.dtype != dst.dtype or add.stride(-1) != 1)):
        dst.copy_(node.opdef.run(ins, attrs)[0])
        return dsts
    t, n = x.shape[0], w.shape[0]
    slots, width, _ = a.shape
    ws = be.workspace(node, ins, attrs)
    prod_cells, _ = lora_workspace_layout(*(Spec(tuple(v.shape), v.dtype) for v in (x, w, a)), product=silu)
    scratch = ws[t * prod_cells:]
    ready = all(be.step_constant(node.inputs[i]) for i in (len(ins) - 3, len(ins) - 1))   # A, idx
    if t <= MAX_BGMV_ROWS and gemv_supported(x, w) and idx.dtype == torch.int32:
        p = lora_shrink(x, a, idx, scratch, inputs_ready=ready)
        gemv(x, w, add, silu_mul=silu, out=dst, workspace=be.gemv_workspace, lora=GemvLoRA(p, b, idx))
        return dsts
    prod = lora_dense_view(ws, t, n, x.dtype) if silu else dst
    v = None
    if t > MAX_BGMV_ROWS:       # first: its launch and A reads overlap the previous kernel's tail (PDL)
        v = lora_shrink_dense(x, a, idx, lora_dense_view(scratch, t, slots * width, x.dtype),
                              scratch=be._workspaces, inputs_ready=ready)
    if add is not None:
        torch.addmm(add, x, w.T, out=prod)
    else:
        torch.matmul(x, w.T, out=prod)
    if v is None:
        lora_apply(prod, x, a, b, idx, out=prod, workspace=scratch, dense=False)
    elif silu:
        return [silu_mul_lora(prod, v, b, dst)]
    else:
        prod.addmm_(v, b.view(n, slots * width).T)
    if silu:
        _silu_mul(be, node, [prod], attrs, [dst])
    return dsts


def _matmul(be: TritonBackend, node, ins, attrs, dsts):
    if node.op in _LORA_MATMULS:
        return _lora_matmul(be, node, ins, attrs, dsts)
    a, b = _operands(ins, attrs)
    dst = dsts[0]
    if node.op == "matmul_silu_mul":
        return [_matmul_silu_mul(be, node, ins, attrs, a, b, dst)]
    if node.op in ("matmul", "matmul_add") and attrs.get("transpose_b") and not attrs.get("transpose_a") \
            and _gemv_rows(ins[0], ins[1], dst):
        add = ins[2] if node.op == "matmul_add" else None
        if add is None or (add.dtype == dst.dtype and add.stride(-1) == 1):
            from ..kernels.gemv import gemv
            gemv(ins[0], ins[1], add, out=dst, workspace=be.gemv_workspace, rms_in=be.norms.rms_in(node),
                 tp_in=be.tp_carry.tp_in(node))
            return [dst]
    _not_carried(be, node)
    if _dry_pass() and node.op in ("matmul", "matmul_add"):
        return [dst]
    if node.op == "matmul_add":
        c = ins[2]
        if a.dim() == 2 and b.dim() == 2 and c.dtype == dst.dtype:
            torch.addmm(c, a, b, out=dst)
        else:
            torch.add(torch.matmul(a, b), c, out=dst)
        return [dst]
    if node.op == "matmul":
        torch.matmul(a, b, out=dst)
        return [dst]
    dst.copy_(node.opdef.run(ins, attrs)[0])
    return [dst]


_LOWERINGS = {"fused": _fused, "add_rms_norm": _add_rms_norm, "silu_mul": _silu_mul, "rope_cache": _rope_cache,
              "paged_attention": _paged_attention, "rope_cache_attention": _rope_cache_attention,
              "paged_mla_attention": _paged_mla_attention, "moe_experts": _moe_experts,
              "quant_moe_experts": _quant_moe_experts, "lora_apply": _lora_apply,
              "reshape_and_cache": _reshape_and_cache, "quant_linear": _quant_linear,
              "quant_linear_silu_mul": _quant_linear, "quant_linear_add": _quant_linear, "embedding": _embedding,
              "topk": _topk, "index_mask": _index_mask, "rope": _rope, "cat": _cat}
_QUANT_OPS = ("quant_linear", "quant_linear_silu_mul", "quant_linear_add")
# hand-written kernels; their torch references run on plain CPU
_KERNEL_OPS = {"paged_attention", "rope_cache_attention", "reshape_and_cache", "paged_mla_attention", "moe_experts",
               "quant_moe_experts", "lora_apply", "embedding", "topk", "index_mask", *_QUANT_OPS}
