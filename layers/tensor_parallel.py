"""Tensor parallelism as a transform of a module tree, driven by the Parameters' shard specs.

:func:`shard_tensor_parallel` turns a full (unsharded) tree into rank ``r`` of ``W``'s share of it,
in place and before anything is recorded or loaded: every parameter with a ``shard_dim`` shrinks to
its slice, each layer kind gets the collective its math needs, and each sharded layer lists which
part of each checkpoint tensor it holds (``CheckpointSlot.source``) so loaders read only that.
Model files stay pure architecture: they never see the world size.

The rules, with ``x`` the (replicated) input of a layer and ``W_r`` rank r's slice:

* column-parallel linear (``shard_dim=0``): ``y_r = x @ W_r.T`` — rank r's output columns; the next
  row-parallel layer consumes them as they are. Merged gate|up and q|k|v split each part separately,
  so ``[gate_r | up_r]`` and ``[q_r | k_r | v_r]`` stay consistent with the split that follows.
* row-parallel linear (``shard_dim=1``): ``y = all_reduce(x_r @ W_r.T) + b`` — the bias once.
* attention: rank r keeps query heads ``[r·H/W, (r+1)·H/W)`` and their KV heads; when there are
  fewer KV heads than ranks (``K < W``, ``W % K == 0``) each KV head is replicated on the ``W/K``
  ranks whose query heads use it. The KV cache is allocated per rank for the local KV heads.
* vocab-parallel embedding: rows ``[r·V', (r+1)·V')`` with ``V' = ceil(V/W)`` (the last rank's tail
  is zero padding); ``e = all_reduce(where(id in range, table_r[id - r·V'], 0))``.
* vocab-parallel LM head: ``logits = all_gather(x @ W_r.T, dim=-1)[..., :V]``.
* MoE experts, tensor-parallel (default): every expert's intermediate size is split like a gated
  MLP, ``y = all_reduce(Σ_e routing_e · mlp_e,r(x))``; expert-parallel (``expert_parallel=True``):
  rank r holds experts ``[r·E/W, (r+1)·E/W)`` whole, ``y = all_reduce(Σ_{e local} routing_e ·
  mlp_e(x))``. The router stays replicated.

Parameters without a shard spec (norms, routers, gates) stay whole on every rank. A module that has
sharded parameters but no rule here (MLA, Bloom's per-head q/k/v) is refused with an error naming it.
"""
from __future__ import annotations

from dataclasses import dataclass

from graphdsl import Module, Parameter
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

from .attention import Attention
from .embedding import VocabParallelEmbedding
from .linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVLayout, QKVParallelLinear,
                     RowParallelLinear)
from .mla import MLAttention
from .moe import FusedExperts

__all__ = ["TensorParallel", "shard_tensor_parallel", "local_kv_heads"]


@dataclass(frozen=True)
class TensorParallel:
    """Which share of the model a process holds: ``rank`` of ``world_size``."""

    rank: int
    world_size: int

    def __post_init__(self):
        for name in ("rank", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise GraphDSLError(f"TensorParallel: {name} must be an int, got {v!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise GraphDSLError(f"TensorParallel: need world_size >= 1 and 0 <= rank < world_size, got "
                                f"rank={self.rank}, world_size={self.world_size}")

    def split(self, size: int, what: str) -> tuple[int, int]:
        """``(start, length)`` of this rank's equal share of ``size``; ``size % world_size`` must be 0."""
        if size % self.world_size:
            raise GraphDSLError(f"tensor parallel: {what} ({size}) must be a multiple of the world size "
                                f"({self.world_size})")
        n = size // self.world_size
        return self.rank * n, n

    def padded_split(self, size: int) -> tuple[int, int, int]:
        """``(start, length, valid)``: shares of ``ceil(size / world_size)``; the last ones may hold
        fewer than ``length`` real rows (``valid``), the rest is padding."""
        n = -(-size // self.world_size)
        start = self.rank * n
        return start, n, max(0, min(n, size - start))


def local_kv_heads(num_kv_heads: int, world_size: int) -> int:
    """KV heads one rank holds: ``K / W``, or 1 when the ``K < W`` heads are replicated."""
    return max(1, num_kv_heads // world_size)


def shard_tensor_parallel(root: Module, rank: int, world_size: int, *, vocab_heads: tuple[str, ...] = ("lm_head",),
                          expert_parallel: bool = False) -> Module:
    """Make ``root`` (in place) rank ``rank``'s share of a ``world_size``-way tensor-parallel model.

    Args:
        vocab_heads: dotted paths of column-parallel layers whose output is the vocabulary (their
            shards are all-gathered into whole logits).
        expert_parallel: split MoE experts across ranks instead of splitting each expert.

    World size 1 leaves the tree as it is. Returns ``root``.
    """
    tp = TensorParallel(rank, world_size)
    if world_size == 1:
        return root
    modules = list(root.named_modules())
    done: set[int] = set()
    for path, m in modules:
        if isinstance(m, MLAttention):
            raise GraphDSLError(f"tensor parallel: multi-head latent attention at '{path}' is not supported yet")
        if isinstance(m, Attention):
            _shard_attention(m, tp)
            done.update({id(m.qkv_proj), id(m.o_proj)})
    for path, m in modules:
        if id(m) in done:
            continue
        if isinstance(m, QKVParallelLinear):
            _shard_qkv(m, tp)
        elif isinstance(m, MergedColumnParallelLinear):
            _shard_merged(m, tp, path)
        elif isinstance(m, ColumnParallelLinear) and m.weight.shard_dim is not None:
            if path in vocab_heads:
                _retype(m, _VocabParallelHead, tp=tp, vocab_size=m.out_features)
                _shard_rows(m, tp, padded=True)
            else:
                _retype(m, _ShardedColumn, tp=tp, full_out=m.out_features)
                _shard_rows(m, tp, padded=False, what=f"{path} out_features")
        elif isinstance(m, RowParallelLinear):
            _shard_row_parallel(m, tp, path)
        elif isinstance(m, VocabParallelEmbedding):
            _retype(m, _VocabParallelEmbedding, tp=tp, vocab_size=m.num_embeddings)
            _shard_rows(m, tp, padded=True)
        elif isinstance(m, FusedExperts):
            _shard_experts(m, tp, path, expert_parallel)
        else:
            bad = [n for n, p in m._parameters.items() if p is not None and p.shard_dim is not None]
            if bad:
                raise GraphDSLError(f"tensor parallel: {type(m).__name__} at '{path}' has sharded parameters "
                                    f"{bad} but no tensor-parallel rule (supported: linears, embedding, attention, "
                                    f"MoE experts)")
    return root


# -- helpers -----------------------------------------------------------------------------------
def _retype(m: Module, cls: type, **attrs) -> None:
    """Give ``m`` the sharded subclass ``cls`` (same attributes, same paths) and extra attributes."""
    if type(m) not in cls.__mro__:      # a subclass (quantized, LoRA...) may compute otherwise: no silent swap
        raise GraphDSLError(f"tensor parallel: no rule for {type(m).__name__} (a subclass of "
                            f"{cls.__mro__[2].__name__}); it cannot be sharded as {cls.__name__}")
    object.__setattr__(m, "__class__", cls)
    for k, v in attrs.items():
        object.__setattr__(m, k, v)


def _resize(m: Module, leaf: str, shape: tuple) -> None:
    old: Parameter = m._parameters[leaf]
    setattr(m, leaf, Parameter(shape, old.dtype, old.shard_dim))


def _shard_rows(m: ColumnParallelLinear | VocabParallelEmbedding, tp: TensorParallel, *, padded: bool,
                what: str = "") -> None:
    """Split dim 0 of ``weight`` (and ``bias``); record the checkpoint rows this rank reads."""
    full = m.weight.shape[0]
    if padded:
        start, n, valid = tp.padded_split(full)
    else:
        start, n = tp.split(full, what)
        valid = n
    rest = tuple(m.weight.shape[1:])
    _resize(m, "weight", (n,) + rest)
    slots = [("weight", "weight", (slice(0, valid),), (full,) + rest, None, (slice(start, start + valid),))]
    if getattr(m, "bias", None) is not None:
        _resize(m, "bias", (n,))
        slots.append(("bias", "bias", (slice(0, valid),), (full,), None, (slice(start, start + valid),)))
    if isinstance(m, ColumnParallelLinear):
        m.out_features = n
    else:
        m.num_embeddings = n
    object.__setattr__(m, "_tp_slots", tuple(slots))


class _SlotsFromTable:
    """Mixin: ``checkpoint_slots`` yields the table the transform recorded."""

    def checkpoint_slots(self):
        yield from self._tp_slots


class _ShardedColumn(_SlotsFromTable, ColumnParallelLinear):
    """Column-parallel linear, rank's output rows (the consumer is row-parallel: no collective)."""


class _VocabParallelHead(_SlotsFromTable, ColumnParallelLinear):
    """The LM head's vocabulary shard; logits all-gathered and the padding cut off."""

    def forward(self, x):
        local = F.linear(x, self.weight, self.bias, transpose_b=True)
        full = F.all_gather(local, dim=-1, world_size=self.tp.world_size)
        if self.out_features * self.tp.world_size == self.vocab_size:
            return full
        return F.slice(full, dim=-1, start=0, end=self.vocab_size)


class _VocabParallelEmbedding(_SlotsFromTable, VocabParallelEmbedding):
    """Rank's vocabulary rows; ids outside them look up row 0 and are zeroed, then summed over ranks."""

    def forward(self, ids):
        lo = self.tp.rank * self.num_embeddings
        hi = lo + self.num_embeddings
        mine = F.where(ids >= lo, ids < hi, ids >= lo)     # lo <= id < hi
        local = F.where(mine, ids - lo, ids * 0)
        rows = F.embedding(local, self.weight)
        rows = F.where(mine.unsqueeze(-1), rows, rows * 0.0)
        out = F.all_reduce(rows, world_size=self.tp.world_size)
        return out if self.scale == 1.0 else out * self.scale


class _ShardedRowParallel(_SlotsFromTable, RowParallelLinear):
    """Row-parallel linear: partial products all-reduced, then the bias (added once)."""

    def forward(self, x):
        y = F.all_reduce(F.linear(x, self.weight, None, transpose_b=True), world_size=self.tp.world_size)
        return y if self.bias is None else y + self.bias


def _shard_row_parallel(m: RowParallelLinear, tp: TensorParallel, what: str, *, cols: tuple[int, int] | None = None):
    """Split ``weight``'s input dim; ``cols`` overrides the checkpoint columns (start, length)."""
    start, n = cols if cols is not None else tp.split(m.in_features, f"{what} in_features")
    _retype(m, _ShardedRowParallel, tp=tp)
    _resize(m, "weight", (m.out_features, n))
    slots = [("weight", "weight", (), (m.out_features, m.in_features), None, (slice(None), slice(start, start + n)))]
    if m.bias is not None:
        slots.append(("bias", "bias", (), (m.out_features,)))
    m.in_features = n
    object.__setattr__(m, "_tp_slots", tuple(slots))


class _ShardedMerged(_SlotsFromTable, MergedColumnParallelLinear):
    """gate|up (or any merged column-parallel layer): each part split on its own."""


def _merged_slots(m: MergedColumnParallelLinear, parts: list[tuple[str, int, int, int]]):
    """Slots of a merged layer from ``(source, full size, start in source, local size)`` per part."""
    slots, at = [], 0
    for src, full, start, n in parts:
        slots.append((f"{src}.weight", "weight", (slice(at, at + n),), (full, m.in_features), None,
                      (slice(start, start + n),)))
        if m.bias is not None:
            slots.append((f"{src}.bias", "bias", (slice(at, at + n),), (full,), None, (slice(start, start + n),)))
        at += n
    return tuple(slots)


def _set_merged(m: MergedColumnParallelLinear, cls: type, tp: TensorParallel,
                parts: list[tuple[str, int, int, int]]) -> None:
    _retype(m, cls, tp=tp)
    m.output_sizes = [n for *_, n in parts]
    m.out_features = sum(m.output_sizes)
    _resize(m, "weight", (m.out_features, m.in_features))
    if m.bias is not None:
        _resize(m, "bias", (m.out_features,))
    object.__setattr__(m, "_tp_slots", _merged_slots(m, parts))


def _shard_merged(m: MergedColumnParallelLinear, tp: TensorParallel, path: str) -> None:
    if not m.sources:
        raise GraphDSLError(f"tensor parallel: merged linear at '{path}' reads one fused checkpoint tensor; "
                            f"only layers with per-part sources can be sharded")
    parts = []
    for src, size in zip(m.sources, m.output_sizes):
        start, n = tp.split(size, f"{path} part {src!r}")
        parts.append((src, size, start, n))
    _set_merged(m, _ShardedMerged, tp, parts)


class _ShardedQKV(_SlotsFromTable, QKVParallelLinear):
    """q|k|v with this rank's query heads and their (possibly replicated) KV heads."""


def _qkv_parts(m: QKVParallelLinear, tp: TensorParallel) -> tuple[int, int, list]:
    """``(local heads, local KV heads, merged parts)`` of rank ``tp.rank``."""
    h, k, d, w = m.num_heads, m.num_kv_heads, m.head_dim, tp.world_size
    if h % w:
        raise GraphDSLError(f"tensor parallel: num_heads ({h}) must be a multiple of the world size ({w})")
    if k >= w:
        if k % w:
            raise GraphDSLError(f"tensor parallel: num_kv_heads ({k}) must be a multiple of the world size ({w}) "
                                f"(or divide it, to be replicated)")
        kv_first, kl = tp.rank * (k // w), k // w
    else:
        if w % k:
            raise GraphDSLError(f"tensor parallel: with fewer KV heads ({k}) than ranks ({w}), the world size must "
                                f"be a multiple of num_kv_heads to replicate them")
        kv_first, kl = tp.rank // (w // k), 1
    hl = h // w
    q_src, k_src, v_src = m.sources
    parts = [(q_src, h * d, tp.rank * hl * d, hl * d), (k_src, k * d, kv_first * d, kl * d),
             (v_src, k * d, kv_first * d, kl * d)]
    return hl, kl, parts


def _shard_qkv(m: QKVParallelLinear, tp: TensorParallel) -> None:
    if m.layout is not QKVLayout.SEPARATE:
        raise GraphDSLError(f"tensor parallel: q/k/v layout {m.layout.value!r} is not supported (only "
                            f"{QKVLayout.SEPARATE.value!r})")
    hl, kl, parts = _qkv_parts(m, tp)
    _set_merged(m, _ShardedQKV, tp, parts)
    m.num_heads, m.num_kv_heads = hl, kl


def _shard_attention(m: Attention, tp: TensorParallel) -> None:
    full_heads = m.num_heads
    _shard_qkv(m.qkv_proj, tp)
    hl, d = m.qkv_proj.num_heads, m.head_dim
    m.num_heads, m.num_kv_heads = hl, m.qkv_proj.num_kv_heads
    if m.alibi_slopes is not None:
        m.alibi_slopes = m.alibi_slopes[tp.rank * hl:(tp.rank + 1) * hl]
    if m.o_proj.in_features != full_heads * d:
        raise GraphDSLError(f"tensor parallel: o_proj in_features ({m.o_proj.in_features}) != heads * head_dim")
    _shard_row_parallel(m.o_proj, tp, "o_proj", cols=(tp.rank * hl * d, hl * d))


class _TPExperts(_SlotsFromTable, FusedExperts):
    """Experts, each split tensor-parallel over its intermediate size; partial outputs all-reduced.
    Online quantization stores a rank's shard of each stack (the down stack's groups and scales
    over its share of the inputs)."""

    def forward(self, x, routing):
        return F.all_reduce(super().forward(x, routing), world_size=self.tp.world_size)


class _EPExperts(_SlotsFromTable, FusedExperts):
    """Experts ``[first, first + num_experts)`` held whole; their weighted outputs all-reduced."""

    def forward(self, x, routing):
        mine = F.slice(routing, dim=-1, start=self.first_expert, end=self.first_expert + self.num_experts)
        return F.all_reduce(super().forward(x, mine), world_size=self.tp.world_size)


def _shard_experts(m: FusedExperts, tp: TensorParallel, path: str, expert_parallel: bool) -> None:
    gate, up, down = m.sources
    e, i, h = m.num_experts, m.intermediate_size, m.hidden_size
    slots = []
    if expert_parallel:
        first, el = tp.split(e, f"{path} num_experts")
        _retype(m, _EPExperts, tp=tp, first_expert=first)
        m.num_experts = el
        if getattr(m, "top_k", None) is not None:       # a row has at most that many local choices
            m.top_k = min(m.top_k, el)
        for g in range(e):
            j, held = g - first, first <= g < first + el     # other ranks' experts: expected, not read
            j = j if held else 0
            slots += [(f"{g}.{gate}.weight", "gate_up_proj", (j, slice(0, i)), (i, h), None, (), held),
                      (f"{g}.{up}.weight", "gate_up_proj", (j, slice(i, 2 * i)), (i, h), None, (), held),
                      (f"{g}.{down}.weight", "down_proj", (j,), (h, i), None, (), held)]
        _resize(m, "gate_up_proj", (el, 2 * i, h))
        _resize(m, "down_proj", (el, h, i))
    else:
        start, il = tp.split(i, f"{path} intermediate_size")
        _retype(m, _TPExperts, tp=tp)
        m.intermediate_size = il
        rows, cols = (slice(start, start + il),), (slice(None), slice(start, start + il))
        for j in range(e):
            slots += [(f"{j}.{gate}.weight", "gate_up_proj", (j, slice(0, il)), (i, h), None, rows),
                      (f"{j}.{up}.weight", "gate_up_proj", (j, slice(il, 2 * il)), (i, h), None, rows),
                      (f"{j}.{down}.weight", "down_proj", (j,), (h, i), None, cols)]
        _resize(m, "gate_up_proj", (e, 2 * il, h))
        _resize(m, "down_proj", (e, h, il))
    object.__setattr__(m, "_tp_slots", tuple(slots))
