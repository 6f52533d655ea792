"""Warm-up: run the step shapes a server will meet before the first request does.

The first step of each shape pays for what later steps of it reuse: Triton compiles a kernel for
each new specialisation (seconds each with a cold cache), the engine plans the shape (~80 ms on
the 8B shape), a decode batch bucket captures its CUDA graph, the sampler's kernels compile on
the first sampled step. In a server those costs land on the first requests: on an H200 with a
cold Triton cache, the first 8 s of ``benchmarks/serve.py`` at 16 clients gave 197 output tokens/s
and a TTFT p50 of 1.5 s, against ~1,900 tokens/s and 44 ms once warm. :func:`warm_up` pays them
at start-up instead, as vLLM does with its profile run and graph capture, through
``LLM.generate`` itself (so every path a request takes is the one warmed):

1. the largest step: ``max_num_batched_tokens`` tokens (or what ``max_num_seqs`` prompts of
   ``max_model_len - 1`` tokens hold, if less) in ``max_num_seqs`` prompts, which also grows the
   prefill engine's arena to its size for good (a later regrowth would drop every prefill graph,
   ``ShapeGraphRunner``);
2. where the loop pads prefill steps to buckets (CUDA, ``prefill_pad``): a step of each token
   bucket up to that step (one prompt, or as few as hold it), twice, so every bucket's plan is
   made and its prefill graph captured (a step's signature is its token bucket: the loop pads
   sequences and projected rows to one count). Each costs ~0.1 s on the 8B shape, once;
3. each decode batch bucket ``b`` up to the one holding ``max_num_seqs``: ``b`` prompts of 17
   tokens, 3 new tokens each, half of them greedy and half seeded sampling with temperature, top-k,
   top-p and both penalties (the sampler's kernels), so the decode graph of ``b`` rows is captured
   and the prefill steps of ``17 b`` tokens (buckets divisible by 16 and not) are planned;
4. where a bucket also has decode graphs of wider block tables (the narrowest serves short
   contexts, ``CudaGraphRunner`` widths): for each wider one, ``b`` greedy prompts just too long
   for the next narrower table, 3 new tokens each, so that graph is planned and captured too.

Requests are ordinary requests: their KV blocks are freed when they finish, and later outputs do
not depend on the warm-up (``tests/models/test_warmup.py``).

Where the engines compile Triton kernels ahead (CUDA; :mod:`graphdsl.runtime.precompile`), the
stages run inside one watch. Each kernel this process has not compiled is looked up in Triton's
disk cache; a warm start loads them all and the stages simply run. At the first kernel the cache
lacks, the rest of the warm-up turns dry: every later step runs launching nothing (no CUDA graph is
captured, the sampled tokens read as 0) and records the kernels it would have compiled. They then
compile in one round on worker processes and the stages run again, for real. Before, a cold
warm-up compiled in a round per new plan and per sampler kind, each as long as its slowest kernel
(Llama-3.2-1B at 32 sequences, an H200: 61 kernels in 22 rounds, 32 s of a 38 s warm-up)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from graphdsl.layers import Phase
from graphdsl.runtime import precompile
from graphdsl.runtime.serving.cuda_graphs import BUCKETS, bucket_for
from graphdsl.runtime.serving.loop import prefill_buckets_enabled
from graphdsl.runtime.serving.prefill_pad import token_buckets
from graphdsl.runtime.serving.sampling import SamplingParams

__all__ = ["WarmupReport", "warm_up"]

_PROMPT = 17              # tokens of a decode-bucket prompt (17 b: token buckets with and without 16 | N)
_NEW_TOKENS = 3           # per decode-bucket request: a prefill-sampled token, then decode steps


@dataclass
class WarmupReport:
    """What :func:`warm_up` ran: ``stages`` as ``(label, seconds)`` in order (where the warm-up
    turned dry: its dry stages, marked so, the compile round, then every stage again) and the total
    ``seconds``; ``ahead``: the round's :class:`~graphdsl.runtime.precompile.AheadReport`, or None."""

    stages: list[tuple[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    ahead: precompile.AheadReport | None = None

    def __str__(self) -> str:
        return f"warmed up {len(self.stages)} stages in {self.seconds:.1f}s: " + \
            ", ".join(f"{label} {s:.1f}s" for label, s in self.stages)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The decode batch buckets a loop of ``max_num_seqs`` sequences replays: every bucket up to the
    one holding ``max_num_seqs`` (past the largest, decode runs eagerly: up to the largest)."""
    top = bucket_for(max_num_seqs) or BUCKETS[-1]
    return [b for b in BUCKETS if b <= top]


def _ids(n: int, vocab: int, salt: int) -> list[int]:
    """``n`` token ids spread over the vocabulary (no special meaning; distinct per ``salt``)."""
    return [(salt * 7919 + i * 104729) % vocab for i in range(n)]


def _prompts(tokens: int, count: int, vocab: int, salt: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` tokens together, as even as can be."""
    return [_ids(tokens // count + (i < tokens % count), vocab, salt * 1000 + i) for i in range(count)]


def _wider_tables(llm, rows: int, vocab: int) -> list[tuple[list, SamplingParams]]:
    """Stage 4's ``(prompts, params)`` calls for the decode bucket of ``rows``: per block-table width
    of its graphs past the narrowest, ``rows`` prompts one block-table width too long for the next
    narrower (the decode rows then need ``narrower + 1`` blocks)."""
    widths = llm._executor.decode_widths(rows)
    block = llm._executor.block_size
    calls = []
    for narrower, width in zip(widths, widths[1:]):
        plen = narrower * block
        if plen + _NEW_TOKENS > llm.max_model_len:
            break
        prompts = [_ids(plen, vocab, 50 + i) for i in range(rows)]
        calls.append((prompts, SamplingParams(max_tokens=_NEW_TOKENS, ignore_eos=True, temperature=0)))
    return calls


def warm_up(llm, *, stream=True) -> WarmupReport:
    """Run the stages of the module docstring through ``llm.generate``; one line per stage on
    ``stream`` (True: ``sys.stderr`` at the time of the call; None or False: quiet). Returns a
    :class:`WarmupReport`."""
    if stream is True:
        stream = sys.stderr
    vocab = llm.model.config.vocab_size
    longest = max(1, llm.max_model_len - 1)                       # the longest prompt
    largest = min(llm.max_num_batched_tokens, llm.max_num_seqs * longest)    # the most tokens a step holds
    seqs = min(llm.max_num_seqs, largest)
    one = SamplingParams(max_tokens=1, temperature=0)
    stages = [(f"prefill of {largest} tokens in {seqs} prompts", [(_prompts(largest, seqs, vocab, 0), one)])]
    sampled = dict(temperature=0.8, top_k=50, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5)
    if prefill_buckets_enabled(llm.device):       # one step a call: each holds one bucket's tokens
        buckets = token_buckets(largest)
        steps = [(_prompts(min(b, largest), -(-min(b, largest) // longest), vocab, 2 + k), one)
                 for k, b in enumerate(buckets) for _ in range(2)]
        stages.append((f"prefill graphs of {len(buckets)} token buckets", steps))
    plen = max(1, min(_PROMPT, llm.max_model_len - _NEW_TOKENS))
    new = max(1, min(_NEW_TOKENS, llm.max_model_len - plen))
    wider = []
    for b in decode_buckets(llm.max_num_seqs):
        prompts = [_ids(plen, vocab, 1 + i) for i in range(b)]
        params = [SamplingParams(max_tokens=new, ignore_eos=True,
                                 **(dict(temperature=0) if i % 2 == 0 else dict(sampled, seed=i))) for i in range(b)]
        stages.append((f"decode batch {b}", [(prompts, params)]))
        wider += _wider_tables(llm, b, vocab)
    if wider:
        stages.append((f"{len(wider)} decode graphs of wider block tables", wider))
    report = WarmupReport()
    t0 = time.monotonic()
    if _compiles_ahead(llm):
        ended = []

        def watched() -> None:
            ended.append(_run_stages(llm, stages, report, stream))
            if stream and precompile.dry_pass_running():        # the round runs next, silent for seconds
                print("warm-up: compiling the kernels missing from Triton's cache on worker processes ...",
                      file=stream, flush=True)
        report.ahead = precompile.run_ahead(watched, "warm-up")
        if report.ahead is not None:
            a = report.ahead
            label = (f"{a.compiled} kernels missing from Triton's cache compiled on {a.workers} workers"
                     + (f" ({len(a.failed)} left to the steps)" if a.failed else "")
                     + (f" (the dry stages stopped early: {a.dry_error})" if a.dry_error else ""))
            report.stages.append((label, time.monotonic() - (ended[0] if ended else t0)))
            if stream:
                print(f"warm-up: {label} in {report.stages[-1][1]:.1f}s; the stages again, for real",
                      file=stream, flush=True)
            _run_stages(llm, stages, report, stream)
    else:
        _run_stages(llm, stages, report, stream)
    report.seconds = time.monotonic() - t0
    return report


def _compiles_ahead(llm) -> bool:
    """Whether the warm-up runs watched: the decode engine's backend compiles ahead on this device."""
    engine = llm.model.engine(Phase.DECODE)
    applies = getattr(engine.backend, "ahead_applies", None)
    return applies is not None and applies(engine.net.nodes, llm.device)


def _run_stages(llm, stages: list, report: WarmupReport, stream) -> float:
    """Run ``stages`` through ``llm.generate``, appending ``(label, seconds)`` to ``report.stages``
    (a stage that ended in a dry pass is marked) and printing a line each on ``stream``; returns the
    clock at the end. In a dry pass a call repeating the one before (stage 2's second step of a
    bucket, for its graph) is skipped: it would record no kernel the first did not."""
    for k, (label, calls) in enumerate(stages, 1):
        t = time.monotonic()
        last = None
        for call in calls:
            if call == last and precompile.dry_pass_running():   # a repeat is there to capture a graph,
                continue                                         # which a dry pass does not
            llm.generate(*call, use_tqdm=False)
            last = call
        if precompile.dry_pass_running():
            label += " (dry: recording the kernels to compile)"
        report.stages.append((label, time.monotonic() - t))
        if stream:
            print(f"warm-up {k}/{len(stages)}: {label} {report.stages[-1][1]:.1f}s", file=stream, flush=True)
    return time.monotonic()
