"""Prefill steps padded to a few shapes, so an engine specialises once per bucket, not per step.

An engine keeps one plan (shapes, arena offsets) and the backend one set of prepared kernels per
input-shape signature. Prefill steps mix prompts of every length, so unpadded, nearly each step
has a new signature and pays for specialising (and the caches grow without bound in a server).
:func:`pad_prefill` pads the step's standard inputs to buckets:

* tokens ``N`` → :func:`token_bucket` (a multiple of ``2^(⌊log2 N⌋ - 3)``, at least 16: at most
  1/8 padding, eight buckets an octave): padding tokens have id 0, position 0 and cache slot -1
  (no cache write) and belong to no sequence (``query_start_loc``'s last entry stays ``N``), so
  attention never reads them and they touch no real row (every other op is row-wise);
* sequences ``S`` → the next power of two, and at least ``seq_bucket`` (the serving loop passes
  the power of two holding ``max_num_seqs``, so every step of a loop has one sequence count):
  padding sequences come *first*, with no tokens (``query_start_loc`` starts with as many more
  0s), ``seq_lens`` 0 and block-table rows of 0. The prefill attention numbers its tiles by
  sequence and launches the last ones first (the heaviest under causality): padding at the end
  would launch up to ``max_num_seqs`` empty programs a KV head ahead of every real tile, each
  searching for its sequence before it exits (+0.1 ms on a 511-token Llama-3.2-1B prompt at 256
  sequences, H200); at the front they launch last and exit in the real tiles' shadow;
* block-table width → the model's ``max_blocks_per_seq`` when that is at most :data:`WIDTH_FLOOR`
  blocks (one width for every step), else the next power of two of at least ``WIDTH_FLOOR`` and at
  most ``max_blocks_per_seq``; padded with block 0 as decode's CUDA graphs do. The attention reads a
  sequence's table only up to its ``seq_lens``, so a wider table costs only its zeros, while every
  width is one more shape signature: a new plan (~80-100 ms on the 8B shape, H200) and a new
  prefill graph (``ShapeGraphRunner``);
* projected rows (``lm_head_indices``, ``H``) → the next power of two, and at least the padded
  sequence count (so the rows follow the sequences unless prompt logprobs project more), padding
  rows projecting token 0; the caller keeps the first ``H`` rows of the logits. Up to a few hundred
  rows the lm_head's weight read, not its rows, sets its time;
* ``lora_indices`` (optional, LoRA steps) → padded with -1: padding tokens use no adapter.

So within a serving loop the signature of a step is, nearly always, its token bucket alone: a
server meets at most 57 of them up to 2048 tokens, and ``LLM.warmup`` plans and captures them all
before the first request. A real row's values do not depend on the padding (the tests compare
padded and unpadded steps).
"""
from __future__ import annotations

import torch

__all__ = ["STANDARD_INPUTS", "WIDTH_FLOOR", "token_bucket", "token_buckets", "pad_prefill"]

STANDARD_INPUTS = frozenset({"input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                             "query_start_loc", "lm_head_indices"})
WIDTH_FLOOR = 512   # blocks: a padded block table is at least this wide (or the model's width, if smaller)


def token_bucket(n: int, minimum: int = 16) -> int:
    """``n`` rounded up to a multiple of ``2^(⌊log2 n⌋ - 3)`` (at most 1/8 more), at least ``minimum``."""
    if n <= minimum:
        return minimum
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


def token_buckets(up_to: int) -> list[int]:
    """Every bucket :func:`token_bucket` gives for ``1..up_to`` tokens, ascending."""
    out, n = [], 1
    while n <= up_to:
        b = token_bucket(n)
        out.append(b)
        n = b + 1
    return out


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _extend(x: torch.Tensor, rows: int, value, front: bool = False) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = torch.full((rows - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if front else [x, pad])


def pad_prefill(inputs: dict[str, torch.Tensor], max_width: int,
                seq_bucket: int = 1) -> tuple[dict[str, torch.Tensor], int]:
    """``(padded inputs, H)``: ``inputs`` (exactly :data:`STANDARD_INPUTS`, and optionally
    ``lora_indices``) padded to their buckets, sequences to at least ``seq_bucket``
    (module docstring); ``H`` is the number of real projected rows. Device-side ops only."""
    n, s = inputs["input_ids"].shape[0], inputs["seq_lens"].shape[0]
    h = inputs["lm_head_indices"].shape[0]
    tokens, seqs = token_bucket(n), max(_pow2(s), _pow2(seq_bucket))
    heads = max(_pow2(h), seqs)
    bt = inputs["block_tables"]
    width = max(bt.shape[1], min(max(_pow2(bt.shape[1]), WIDTH_FLOOR), max_width))
    if width != bt.shape[1]:
        bt = torch.cat([bt, bt.new_zeros(bt.shape[0], width - bt.shape[1])], 1)
    qsl = inputs["query_start_loc"]
    out = {"input_ids": _extend(inputs["input_ids"], tokens, 0), "positions": _extend(inputs["positions"], tokens, 0),
           "slot_mapping": _extend(inputs["slot_mapping"], tokens, -1),
           "block_tables": _extend(bt, seqs, 0, front=True), "seq_lens": _extend(inputs["seq_lens"], seqs, 0, front=True),
           "query_start_loc": _extend(qsl, seqs + 1, 0, front=True),
           "lm_head_indices": _extend(inputs["lm_head_indices"], heads, 0)}
    if "lora_indices" in inputs:
        out["lora_indices"] = _extend(inputs["lora_indices"], tokens, -1)
    return out, h
