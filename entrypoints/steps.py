"""The inputs of one prefill or decode step of an :class:`~graphdsl.LLM`'s engines, built the way
``LLM.score`` and the serving loop build them (blocks from the LLM's block manager, RoPE tables
and model-specific inputs added), for tools that drive an engine directly (``diff``, ``profile``)."""
from __future__ import annotations

import torch

__all__ = ["prefill_feed", "decode_feed"]


def _finish(llm, engine, feed: dict) -> dict:
    extra, _, _ = llm.model._update_model_inputs(feed)
    feed.update(extra)
    if "cos" in engine.net.inputs and "cos" not in feed:
        feed["cos"], feed["sin"] = llm.model.rotary.cos_sin(feed["positions"])
    return {k: v for k, v in feed.items() if k in engine.net.inputs and k not in engine._weights}


def prefill_feed(llm, engine, ids: list[int], sid, *, all_logits: bool = True) -> dict:
    """A prefill of ``ids`` as sequence ``sid`` (its blocks allocated here; the caller frees them);
    logits of every position (``all_logits``) or of the last."""
    t, n = llm._tensor, len(ids)
    llm.blocks.allocate(sid, n)
    feed = {"input_ids": t(ids, torch.int64), "positions": t(list(range(n)), torch.int64),
            "slot_mapping": t(llm.blocks.slot_mapping(sid, 0, n), torch.int64),
            "block_tables": t([llm.blocks.block_table(sid)], torch.int32),
            "seq_lens": t([n], torch.int32), "query_start_loc": t([0, n], torch.int32),
            "lm_head_indices": t(list(range(n)) if all_logits else [n - 1], torch.int64)}
    return _finish(llm, engine, feed)


def decode_feed(llm, engine, token: int, context: int, sid) -> dict:
    """One decode step of sequence ``sid`` holding ``context - 1`` cached tokens, feeding ``token``
    at position ``context - 1`` (its blocks grown to ``context`` here)."""
    t = llm._tensor
    if sid not in llm.blocks:
        llm.blocks.allocate(sid, context)
    elif llm.blocks.num_tokens(sid) < context:
        llm.blocks.append(sid, context - llm.blocks.num_tokens(sid))
    feed = {"input_ids": t([token], torch.int64), "positions": t([context - 1], torch.int64),
            "slot_mapping": t(llm.blocks.slot_mapping(sid, context - 1, context), torch.int64),
            "block_tables": t([llm.blocks.block_table(sid)], torch.int32),
            "seq_lens": t([context], torch.int32)}
    return _finish(llm, engine, feed)
