"""Paged KV cache storage and the block manager that hands its blocks to sequences.

Layout (vLLM "flash", what ``graphdsl.functional.reshape_and_cache`` / ``paged_attention`` read):
one key and one value tensor per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token ``p`` of a sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``,
i.e. at flat slot ``table[p // block_size] * block_size + p % block_size``.

:class:`BlockManager` is pure bookkeeping (no tensors): a free list of block ids, and per sequence
its block table and token count. Tables only grow (``append``) until ``free``. Running out raises
:class:`OutOfBlocks` with the numbers, and leaves the manager unchanged. Full blocks can be shared:
``fork(parent, child, n)`` gives ``child`` the parent's first ``n // block_size`` blocks (the
``n`` parallel samples of one prompt read one copy of its KV); a block returns to the free list
when the last sequence holding it is freed. Shared blocks are never written again: a sequence
only writes positions past the shared prefix, which live in blocks of its own.
"""
from __future__ import annotations

import array
import math
import numbers
import os
from typing import Hashable

import torch

from graphdsl.dtypes import dtype_str, to_dtype
from graphdsl.errors import GraphDSLError

__all__ = ["PagedKVCache", "BlockManager", "OutOfBlocks", "decode_slots"]


class OutOfBlocks(GraphDSLError):
    """Not enough free KV-cache blocks for a request; ``needed``/``free``/``total`` say how many."""

    def __init__(self, message: str, *, needed: int, free: int, total: int) -> None:
        super().__init__(message)
        self.needed, self.free, self.total = needed, free, total


def _positive_int(name: str, v, *, allow_zero: bool = False) -> int:
    """``v`` as a Python int (numpy/torch integer scalars accepted) if it is >= 1 (or >= 0)."""
    lo = 0 if allow_zero else 1
    if not isinstance(v, bool) and isinstance(v, numbers.Integral) and v >= lo:
        return int(v)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point() \
            and v.dtype != torch.bool and int(v) >= lo:
        return int(v)
    raise GraphDSLError(f"{name} must be an integer >= {lo}, got {v!r}")


class PagedKVCache:
    """Per-layer key/value block tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype | str = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        self.num_layers = _positive_int("num_layers", num_layers)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.dtype = to_dtype(dtype, "PagedKVCache dtype")
        if self.dtype is None or not self.dtype.is_floating_point:
            raise GraphDSLError(f"PagedKVCache dtype must be a floating dtype, got {dtype!r}")
        self.device = torch.device(device)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        try:
            self.key_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                               for _ in range(self.num_layers)]
            self.value_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                                 for _ in range(self.num_layers)]
        except (RuntimeError, torch.OutOfMemoryError) as e:
            need = self.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size=block_size,
                                        dtype=self.dtype) * num_blocks
            raise GraphDSLError(f"cannot allocate the KV cache ({num_blocks} blocks, "
                                f"{need / 2**30:.2f} GiB) on {self.device}: "
                                f"{str(e).splitlines()[0]}") from None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.key_caches[0].shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.key_caches) + sum(t.nbytes for t in self.value_caches)

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={dtype_str(self.dtype)}, device={self.device}, {self.nbytes / 2**20:.1f} MiB)")

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, *,
                        block_size: int = 16, dtype: torch.dtype | str = torch.bfloat16) -> int:
        """Bytes one block costs over all layers, keys and values: ``2·L·B·H·D·elem``."""
        dt = to_dtype(dtype, "dtype")
        elem = torch.empty((), dtype=dt).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @staticmethod
    def blocks_for(max_model_len: int, max_num_seqs: int, block_size: int = 16) -> int:
        """Blocks so that ``max_num_seqs`` sequences of ``max_model_len`` tokens all fit."""
        _positive_int("max_model_len", max_model_len)
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("block_size", block_size)
        return math.ceil(max_model_len / block_size) * max_num_seqs

    @staticmethod
    def blocks_for_memory(fraction: float, num_layers: int, num_kv_heads: int, head_dim: int, *,
                          block_size: int = 16, dtype: torch.dtype | str = torch.bfloat16,
                          device: torch.device | str = "cpu") -> int:
        """Blocks that fit in ``fraction`` of the memory currently free on ``device``.

        CUDA: ``torch.cuda.mem_get_info`` free bytes; CPU: ``MemAvailable`` from /proc/meminfo
        (or physical pages available). Raises when not even one block fits.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0.0 < fraction <= 1.0:
            raise GraphDSLError(f"fraction must be a float in (0, 1], got {fraction!r}")
        per_block = PagedKVCache.bytes_per_block(num_layers, num_kv_heads, head_dim,
                                                 block_size=block_size, dtype=dtype)
        free = _free_bytes(torch.device(device))
        n = int(free * fraction) // per_block
        if n < 1:
            raise GraphDSLError(
                f"KV cache: {fraction:.0%} of the {free / 2**20:.1f} MiB free on {device} holds no "
                f"block of {per_block / 2**20:.2f} MiB ({num_layers} layers x {block_size} tokens x "
                f"{num_kv_heads} kv heads x {head_dim} dims x K,V)")
        return n


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        raise GraphDSLError(f"blocks_for_memory supports cuda and cpu devices, got {device}")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class BlockManager:
    """Hands out KV-cache block ids to sequences; tracks each sequence's table and length."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        # a stack popped from the end: lowest ids are handed out first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # tables as int32 arrays: the serving loop copies whole tables into step inputs each time the
        # batch changes, and an array slice is one memcpy where a list is a conversion an entry
        self._tables: dict[Hashable, array.array] = {}
        self._lens: dict[Hashable, int] = {}
        self._refs: dict[int, int] = {}          # block -> number of sequences holding it, when > 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        n_tokens = _positive_int("n_tokens", n_tokens, allow_zero=True)
        return self.blocks_needed(n_tokens) <= len(self._free)

    def can_append(self, seq_id: Hashable, n_new_tokens: int) -> bool:
        return self._extra_blocks(seq_id, n_new_tokens) <= len(self._free)

    def allocate(self, seq_id: Hashable, n_tokens: int) -> list[int]:
        """Give a new sequence blocks for its first ``n_tokens``; returns its block table."""
        n_tokens = _positive_int("n_tokens", n_tokens, allow_zero=True)
        if seq_id in self._tables:
            raise GraphDSLError(f"sequence {seq_id!r} already has blocks; append() to grow it "
                                f"or free() it first")
        self._take(seq_id, self.blocks_needed(n_tokens), f"{n_tokens} tokens")
        self._lens[seq_id] = n_tokens
        return list(self._tables[seq_id])

    def append(self, seq_id: Hashable, n_new_tokens: int) -> list[int]:
        """Grow ``seq_id`` by ``n_new_tokens``, adding blocks as needed; returns its table."""
        extra = self._extra_blocks(seq_id, n_new_tokens)
        total = self._lens[seq_id] + int(n_new_tokens)
        self._take(seq_id, extra, f"{n_new_tokens} more tokens (to {total})")
        self._lens[seq_id] = total
        return list(self._tables[seq_id])

    def try_grow_to(self, seq_id: Hashable, n_tokens: int) -> bool:
        """Make ``seq_id`` hold at least ``n_tokens`` tokens, adding blocks as needed, if the free
        blocks allow: True when it holds them (already, or now), False (and no change) otherwise.
        The scheduler's per-step fast path: one call a running request, no table copy, no exception."""
        have = self._lens.get(seq_id)
        if have is None:
            self._table(seq_id)                   # raises, naming the unknown sequence
        if n_tokens <= have:
            return True
        table = self._tables[seq_id]
        need = -(-n_tokens // self.block_size) - len(table)
        if need > len(self._free):
            return False
        for _ in range(need):
            table.append(self._free.pop())
        self._lens[seq_id] = n_tokens
        return True

    def fork(self, parent: Hashable, child: Hashable, n_tokens: int) -> list[int]:
        """Give the new sequence ``child`` the parent's blocks holding its first ``n_tokens`` tokens,
        shared (no copy); ``n_tokens`` must be a multiple of ``block_size`` within the parent's
        tokens. ``child`` then grows with ``append`` like any sequence. Returns its table."""
        table = self._table(parent)
        n_tokens = _positive_int("n_tokens", n_tokens, allow_zero=True)
        if n_tokens % self.block_size or n_tokens > self._lens[parent]:
            raise GraphDSLError(f"fork({parent!r}, {child!r}, n_tokens={n_tokens}): n_tokens must be a multiple of "
                                f"block_size={self.block_size} and at most the parent's {self._lens[parent]} tokens")
        if child in self._tables:
            raise GraphDSLError(f"fork: sequence {child!r} already has blocks")
        shared = table[:n_tokens // self.block_size]
        for b in shared:
            self._refs[b] = self._refs.get(b, 1) + 1
        self._tables[child], self._lens[child] = array.array("i", shared), n_tokens
        return list(shared)

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``'s blocks; each returns to the free list once no sequence holds it."""
        table = self._table(seq_id)
        for b in reversed(table):
            refs = self._refs.get(b, 1)
            if refs > 2:
                self._refs[b] = refs - 1
            elif refs == 2:
                del self._refs[b]                # one holder left: no count kept
            else:
                self._free.append(b)
        del self._tables[seq_id], self._lens[seq_id]

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._table(seq_id))

    def block_table_array(self, seq_id: Hashable) -> array.array:
        """The sequence's table itself, an int32 ``array.array`` (no copy: read it, do not change
        it; it grows in place as the sequence does)."""
        return self._table(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        self._table(seq_id)
        return self._lens[seq_id]

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of token positions ``start..end-1``: ``table[p // bs] * bs + p % bs``."""
        table = self._table(seq_id)
        n = self._lens[seq_id]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise GraphDSLError(f"slot_mapping({seq_id!r}, start={start!r}, end={end!r}): need "
                                f"0 <= start <= end <= {n} (the sequence's allocated tokens)")
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def __repr__(self) -> str:
        return (f"BlockManager({self.num_free_blocks}/{self.num_blocks} blocks free, "
                f"block_size={self.block_size}, {len(self._tables)} sequences)")

    # -- internals
    def _table(self, seq_id: Hashable) -> array.array:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise GraphDSLError(f"unknown sequence {seq_id!r} (allocate() it first; "
                                f"{len(self._tables)} sequences hold blocks)") from None

    def _extra_blocks(self, seq_id: Hashable, n_new_tokens: int) -> int:
        _positive_int("n_new_tokens", n_new_tokens, allow_zero=True)
        have = len(self._table(seq_id))
        return max(0, self.blocks_needed(self._lens[seq_id] + n_new_tokens) - have)

    def _take(self, seq_id: Hashable, n_blocks: int, what: str) -> None:
        if n_blocks > len(self._free):
            raise OutOfBlocks(
                f"out of KV-cache blocks: sequence {seq_id!r} needs {n_blocks} more blocks for "
                f"{what} at block_size {self.block_size}, but only {len(self._free)} of "
                f"{self.num_blocks} are free",
                needed=n_blocks, free=len(self._free), total=self.num_blocks)
        table = self._tables.setdefault(seq_id, array.array("i"))
        for _ in range(n_blocks):
            table.append(self._free.pop())


def decode_slots(positions: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Cache slot of each decode row's new token, on the device:
    ``block_tables[r, p // bs] * bs + p % bs`` for ``p = positions[r]``, and -1 (write nothing) for
    padding rows (``seq_lens[r] == 0``)."""
    col = torch.div(positions, block_size, rounding_mode="floor").clamp_(0, block_tables.shape[1] - 1)
    block = block_tables.gather(1, col.unsqueeze(1).to(torch.int64)).squeeze(1).to(torch.int64)
    return torch.where(seq_lens > 0, block * block_size + positions % block_size, torch.full_like(positions, -1))
