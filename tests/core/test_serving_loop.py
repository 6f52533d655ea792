"""The serving loop (runtime/serving/loop.py) over a fake model that reads its context only
through the paged KV cache: one-step-late token reads (overlap) change no output, EOS learned a
step late drops the extra token, parallel samples share their prompt's blocks, min_tokens keeps EOS
out, logprobs are the model's raw log-softmax, and an abort frees blocks with a step in flight."""
import random

import pytest
import torch

from graphdsl.runtime.serving.kv_cache import BlockManager
from graphdsl.runtime.serving.loop import ServingLoop
from graphdsl.runtime.serving.sampling import SamplingParams
from graphdsl.runtime.serving.scheduler import RequestStatus, Scheduler
from tests.helpers.fake_model import VOCAB, FakeModel, fake_logits


def _loop(*, num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64, eos=(), overlap=True):
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=max_model_len, eos_token_ids=eos)
    return ServingLoop(FakeModel(blocks, max_model_len), sched, overlap=overlap), sched, blocks


def _drive(loop):
    events = []
    while loop.has_work():
        events += loop.step()
    return events


def _greedy_reference(prompt, max_tokens, eos=(), min_tokens=0):
    """What greedy decoding of the fake model gives, token by token on the host."""
    out = []
    while len(out) < max_tokens:
        logits = fake_logits(prompt + out)
        if len(out) < min_tokens:
            logits[list(eos)] = float("-inf")
        tok = int(logits.argmax())
        out.append(tok)
        if tok in eos and len(out) > min_tokens:
            break
    return out


@pytest.mark.parametrize("overlap", [True, False])
def test_eos_learned_a_step_late_gives_the_host_loop_tokens(overlap):
    rng = random.Random(1)
    eos = (3, 7, 11, 19)
    loop, sched, blocks = _loop(eos=eos, overlap=overlap)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(12)]
    reqs = [sched.add_request(i, p, SamplingParams(max_tokens=20, temperature=0)) for i, p in enumerate(prompts)]
    _drive(loop)
    assert blocks.num_free_blocks == blocks.num_blocks
    stopped = 0
    for r, p in zip(reqs, prompts):
        assert r.output_ids == _greedy_reference(p, 20, eos), r.request_id
        assert r.num_pending == 0 and r.status is RequestStatus.FINISHED
        stopped += r.finish_reason == "stop"
    assert stopped >= 3, "the prompts were meant to hit EOS"


def test_overlap_computes_one_extra_step_only_for_eos():
    """With overlap, a request that stops on EOS is computed one step further (its extra token is
    dropped); a request that stops on length is not."""
    prompt = [5, 6, 7]
    ref = _greedy_reference(prompt, 30)
    eos = (ref[4],)                                        # the fifth greedy token stops it
    steps = {}
    for overlap in (False, True):
        loop, sched, _ = _loop(eos=eos, overlap=overlap)
        r = sched.add_request(0, prompt, SamplingParams(max_tokens=30, temperature=0))
        _drive(loop)
        assert r.output_ids == ref[:5] and r.finish_reason == "stop"
        steps[overlap] = loop.num_steps
    assert steps[True] == steps[False] + 1
    for overlap in (False, True):
        loop, sched, _ = _loop(overlap=overlap)
        r = sched.add_request(0, prompt, SamplingParams(max_tokens=6, temperature=0))
        _drive(loop)
        assert r.output_ids == ref[:6] and loop.num_steps == 6


def test_parallel_samples_share_prompt_blocks():
    loop, sched, blocks = _loop(block_size=4)
    prompt = list(range(10, 24))                           # 14 tokens: 3 full blocks before the last token
    sp = SamplingParams(max_tokens=5, temperature=0)
    parent = sched.add_request(("p", 0), prompt, sp)
    kids = [sched.add_request(("p", i), prompt, sp, parent=parent) for i in (1, 2)]
    loop.step()                                            # parent's prompt; the samples wait for it
    assert all(k.status is RequestStatus.WAITING for k in kids)
    loop.step()                                            # samples admitted, sharing 3 blocks
    shared = blocks.block_table(("p", 0))[:3]
    for k in kids:
        assert blocks.block_table(k.request_id)[:3] == shared and k.num_computed == 14
    assert blocks.num_free_blocks == blocks.num_blocks - (4 + 2 * 1)
    _drive(loop)
    want = _greedy_reference(prompt, 5)
    assert [r.output_ids for r in [parent] + kids] == [want] * 3
    assert blocks.num_free_blocks == blocks.num_blocks


def test_fork_refcounts_return_shared_blocks_once():
    bm = BlockManager(8, 4)
    bm.allocate("a", 10)
    bm.fork("a", "b", 8)
    bm.append("b", 3)
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2] and bm.num_free_blocks == 8 - 3 - 1
    bm.free("a")
    assert bm.num_free_blocks == 8 - 3                      # a's third block back; shared two still held
    bm.free("b")
    assert bm.num_free_blocks == 8 and sorted(bm._free) == list(range(8))
    with pytest.raises(Exception, match="multiple of block_size=4"):
        bm.allocate("c", 6)
        bm.fork("c", "d", 5)


def test_min_tokens_keeps_eos_out():
    eos = tuple(range(0, 45))                              # nearly every token ends the request
    loop, sched, _ = _loop(eos=eos)
    r = sched.add_request(0, [1, 2, 3], SamplingParams(max_tokens=12, min_tokens=4, temperature=0))
    _drive(loop)
    assert r.output_ids == _greedy_reference([1, 2, 3], 12, eos, min_tokens=4)
    assert len(r.output_ids) >= 5 and all(t >= 45 for t in r.output_ids[:4])


def test_logprobs_are_the_raw_log_softmax():
    loop, sched, _ = _loop()
    prompt = [4, 9, 16, 25, 36]
    r = sched.add_request(0, prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3,
                                                    prompt_logprobs=2, presence_penalty=1.5))
    events = _drive(loop)
    assert len(events) == 6 and r.output_ids == [e.token_id for e in events]
    for i, e in enumerate(events):
        ref = torch.log_softmax(fake_logits(prompt + r.output_ids[:i]), dim=0)
        top = ref.topk(3)
        assert set(top.indices.tolist()) <= set(e.logprobs)
        for t, lp in e.logprobs.items():
            assert lp.logprob == pytest.approx(float(ref[t]), abs=1e-5)
            assert lp.rank == 1 + int((ref > ref[t]).sum())
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        ref = torch.log_softmax(fake_logits(prompt[:j]), dim=0)
        pos = r.prompt_logprobs[j]
        assert prompt[j] in pos and len(pos) in (2, 3)
        assert pos[prompt[j]].logprob == pytest.approx(float(ref[prompt[j]]), abs=1e-5)


def test_abort_with_a_step_in_flight_frees_blocks():
    loop, sched, blocks = _loop()
    a = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    b = sched.add_request("b", [4, 5], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(4):
        loop.step()
    assert loop._flight is not None                         # a step is in flight
    loop.abort(a)
    assert a.status is RequestStatus.FINISHED and a.finish_reason == "abort"
    _drive(loop)
    assert b.output_ids == _greedy_reference([4, 5], 8) and blocks.num_free_blocks == blocks.num_blocks
    assert a.num_pending == 0 and len(a.output_ids) <= 5


def test_prompt_logprobs_survive_chunking_and_preemption():
    """A long prompt prefilled in chunks, preempted and recomputed, still gets each prompt
    position's logprob exactly once."""
    loop, sched, _ = _loop(num_blocks=10, block_size=4, budget=6, max_num_seqs=4)
    prompt = list(range(1, 21))
    others = [sched.add_request(i, [7, 7, 7], SamplingParams(max_tokens=16, temperature=0)) for i in range(2)]
    r = sched.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1))
    _drive(loop)
    assert r.num_preemptions > 0, "the pool was meant to preempt the newest request"
    assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        ref = torch.log_softmax(fake_logits(prompt[:j]), dim=0)
        assert r.prompt_logprobs[j][prompt[j]].logprob == pytest.approx(float(ref[prompt[j]]), abs=1e-5)
    assert r.output_ids == _greedy_reference(prompt, 8)
    assert all(o.output_ids == _greedy_reference([7, 7, 7], 16) for o in others)


def _graph_loop(widths, overlap, max_model_len=64):
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=max_model_len)
    model = FakeModel(blocks, max_model_len, graph_widths=widths)
    return ServingLoop(model, sched, overlap=overlap), sched, model


@pytest.mark.parametrize("overlap", [True, False])
def test_rows_move_to_a_wider_graph_when_a_block_table_fills(overlap):
    """Decode graphs of narrower block tables (the attention launches fewer programs): the loop
    starts a batch on the narrowest graph holding its rows' blocks and moves it, pending tokens
    and all, to a wider one when a row's next token needs a block past the table. Greedy outputs
    equal the host loop's; a missed move fails inside the fake graph."""
    rng = random.Random(3)
    loop, sched, model = _graph_loop((2, 4), overlap)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    reqs = [sched.add_request(i, p, SamplingParams(max_tokens=30, temperature=0)) for i, p in enumerate(prompts)]
    _drive(loop)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == _greedy_reference(p, 30), r.request_id
    widths = [w for _, w in model.replays]
    assert {2, 4, 16} <= set(widths)
    assert widths == sorted(widths), "a batch went back to a narrower graph while its rows only grow"


def test_seeded_sampling_is_the_same_through_narrower_graphs():
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    outs = []
    for widths in (None, (2, 4)):
        loop, sched, _ = _graph_loop(widths, True)
        reqs = [sched.add_request(i, p, SamplingParams(max_tokens=25, temperature=0.9, top_k=20, seed=i,
                                                       presence_penalty=0.4))
                for i, p in enumerate(prompts)]
        _drive(loop)
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]


def test_a_graph_narrower_than_a_rows_table_is_refused_by_name():
    """An executor whose graph cannot hold a row's blocks is an error naming the request and the
    widths, never a silent write to a wrong cache slot."""
    from graphdsl.errors import GraphDSLError
    from tests.helpers.fake_model import FakeGraph

    class Narrow(FakeModel):
        def decode_graph(self, n, lora=False, width=None):
            return FakeGraph(self, 1 << (n - 1).bit_length(), 1)
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    loop = ServingLoop(Narrow(blocks, 64), sched)
    sched.add_request("long", list(range(1, 10)), SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(GraphDSLError, match=r"request 'long' holds 3 blocks, more than the decode block "
                                            r"table's width 1 \(max_blocks_per_seq=16\)"):
        _drive(loop)


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 1e-60])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    """vLLM's rule (temperature < 1e-5 is greedy): logits / 1e-39 overflow float32, and 1e-60 is 0
    as float32, which the sampler read as a division by 1 (sampling at temperature 1)."""
    prompt = [5, 6, 7]
    loop, sched, _ = _loop()
    reqs = [sched.add_request(s, prompt, SamplingParams(max_tokens=12, temperature=temperature, seed=s))
            for s in range(4)]
    _drive(loop)
    assert all(r.output_ids == _greedy_reference(prompt, 12) for r in reqs)


def test_a_top_k_or_min_tokens_past_int64_or_the_vocabulary_is_the_same_as_none():
    """A top-k of the whole vocabulary or more keeps every token (as top_k=0); one past int64 no
    longer overflows the sampler's columns, and one near it no longer turns top-p sampling greedy
    (k + the ties counted wrapped around). A min_tokens past int64 bans EOS to the end."""
    prompt = [5, 6, 7]

    def run(**kw):
        loop, sched, _ = _loop(eos=tuple(range(0, 45)))
        r = sched.add_request(0, prompt, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=11, **kw))
        _drive(loop)
        return r.output_ids

    off = run(min_tokens=20)
    assert off != _greedy_reference(prompt, 20), "the seeded draw was meant to leave the argmax"
    for k in (VOCAB, 2**63 - 1, 2**63):
        assert run(top_k=k, min_tokens=20) == off
    loop, sched, _ = _loop(eos=tuple(range(0, 45)), max_model_len=16)
    r = sched.add_request(0, prompt, SamplingParams(max_tokens=2**64, min_tokens=2**63, temperature=0))
    _drive(loop)
    assert len(r.output_ids) == 16 - len(prompt) and all(t >= 45 for t in r.output_ids)
    assert r.finish_reason == "length"


def test_tied_logprobs_share_a_rank_whatever_the_number_asked_for():
    """rank = 1 + the tokens with a strictly larger logprob (outputs.py), in the top list too: tied
    tokens (common with 16-bit logits) share a rank, and a token's rank does not change with k."""
    from graphdsl.runtime.serving.sampler import compute_logprobs
    loop, _, _ = _loop()
    logits = torch.tensor([[2.0, 5.0, 5.0, 1.0, 5.0, 2.0]])
    lp = torch.log_softmax(logits, dim=1)[0]
    want = {t: 1 + int((lp > lp[t]).sum()) for t in range(6)}
    for chosen in range(6):
        for k in range(7):
            ids, lps, tl, tr = (x.tolist() for x in compute_logprobs(logits, torch.tensor([chosen]), k))
            pos = loop._position(ids[0], lps[0], chosen, tl[0], tr[0])
            assert chosen in pos and len(pos) in (k, k + 1)
            assert {t: v.rank for t, v in pos.items()} == {t: want[t] for t in pos}, (chosen, k)


def test_the_first_draw_of_each_kind_runs_watched_and_again_if_it_went_dry(monkeypatch):
    """On CUDA the first draw of each kind runs through precompile.run_ahead on a copy of the logits
    (loop._draw); if it went dry, the draw runs again on the logits. Faked here: the odd watched
    calls 'go dry at once' (nothing ran), the even ones run through. The tokens — sampled with
    seeds and penalties, whose counts a doubled or missing draw would change — must not move."""
    from graphdsl.runtime import precompile
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=6, seed=3, presence_penalty=1.5,
                            frequency_penalty=1.5)

    def run():
        loop, sched, _ = _loop()
        reqs = [sched.add_request(i, p, params) for i, p in enumerate([[1, 2, 3], [4, 5, 6, 7], [9]])]
        _drive(loop)
        return loop, [r.output_ids for r in reqs]
    _, want = run()
    watched = []

    def run_ahead(forward, label, on_dry=None):
        watched.append(label)
        if len(watched) % 2:
            return object()
        forward()
        return None
    monkeypatch.setattr(precompile, "applies", lambda device: True)
    monkeypatch.setattr(precompile, "run_ahead", run_ahead)
    loop, got = run()
    assert got == want
    assert len(watched) == len(loop._drawn) >= 2          # once per kind: the prefill's and the decode's
    assert all(label.startswith("sampler, ") for label in watched)


def test_steps_inside_a_dry_pass_read_back_token_0():
    """Inside a dry pass (a warm-up's watch that turned dry: runtime/precompile.py) the draw launches
    nothing and its tokens are unwritten memory; the loop reads them back as 0, a valid id for the
    host and the next step's inputs. Outside, the same requests get their real tokens."""
    pytest.importorskip("triton")
    from graphdsl.runtime import precompile
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run():
        loop, sched, _ = _loop()
        reqs = [sched.add_request(i, p, params) for i, p in enumerate(prompts)]
        _drive(loop)
        return [r.output_ids for r in reqs]
    want = [_greedy_reference(p, 4) for p in prompts]
    assert any(t for ids in want for t in ids)
    with precompile.defer_launches():
        assert run() == [[0] * 4] * 3
    assert run() == want
