"""``graphdsl profile MODEL``: per-kernel tables of one prefill and one decode step of a model.

The model's real engines run (its backend; eager, so each launch can be timed: a decode step that
serving replays through a CUDA graph runs the same kernels) through
:meth:`~graphdsl.runtime.Engine.profile`; the result holds a :class:`ProfileReport` per phase,
and :func:`write_profile` writes each one's Chrome trace and SVG chart next to an HTML page
holding both tables.
"""
from __future__ import annotations

from html import escape
from pathlib import Path

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.layers import Phase
from graphdsl.runtime.profile import ProfileReport, measure_ceilings

from .steps import decode_feed, prefill_feed

__all__ = ["profile_model", "write_profile"]


def profile_model(llm, *, prompt_tokens: int = 128, context: int | None = None, iters: int = 5,
                  warmup: int = 2, ceilings=None) -> dict[str, ProfileReport]:
    """``{"prefill": report, "decode": report}``: a prefill of ``prompt_tokens`` random tokens, then
    a batch-1 decode step at ``context`` tokens (default ``prompt_tokens + 1``)."""
    for name, v in (("prompt_tokens", prompt_tokens), ("iters", iters)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GraphDSLError(f"profile: {name} must be an int >= 1, got {v!r}")
    context = context or prompt_tokens + 1
    if context > llm.max_model_len:
        raise GraphDSLError(f"profile: context {context} exceeds max_model_len {llm.max_model_len}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, llm.config.vocab_size, (prompt_tokens,), generator=g).tolist()
    ceilings = ceilings or measure_ceilings(llm.device, llm.dtype)
    out = {}
    sid = ("profile", 0)
    try:
        engine = llm.model.engine(Phase.PREFILL)
        feed = prefill_feed(llm, engine, ids, sid, all_logits=False)
        out["prefill"] = engine.profile(feed, iters=iters, warmup=warmup, ceilings=ceilings,
                                        name=f"prefill of {prompt_tokens} tokens")
        engine = llm.model.engine(Phase.DECODE)
        feed = decode_feed(llm, engine, ids[-1], context, sid)
        out["decode"] = engine.profile(feed, iters=iters, warmup=warmup, ceilings=ceilings,
                                       name=f"decode at {context} tokens of context, batch 1")
    finally:
        if sid in llm.blocks:
            llm.blocks.free(sid)
    return out


def write_profile(reports: dict[str, ProfileReport], directory) -> Path:
    """Write ``<phase>.trace.json``, ``<phase>.svg`` and ``profile.html`` (tables and charts)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    body = []
    for phase, rep in reports.items():
        rep.chrome_trace(d / f"{phase}.trace.json")
        svg = rep.svg(d / f"{phase}.svg")
        body.append(f"<h2>{escape(rep.name)}</h2>\n{svg.read_text()}\n<pre>{escape(rep.table())}</pre>")
    page = d / "profile.html"
    page.write_text("<!doctype html>\n<html><head><meta charset='utf-8'><title>graphdsl profile</title></head>"
                    "<body>\n" + "\n".join(body) + "\n</body></html>\n")
    return page
