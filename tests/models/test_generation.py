"""Generation semantics through the LLM API: sampling, seeds, stops, batching, streaming."""
import pytest

import graphdsl as gd
from tests.models.gguf_tiny import build_tiny_gguf

PROMPTS = ["hello there", "the theme", "he", "a b c d e", "zz"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf_model = build_tiny_gguf(tmp_path_factory.mktemp("gen"))
    return gd.LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=2), hf_model


def greedy(n=12, **kw):
    return gd.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_batched_with_few_slots_equals_one_at_a_time(tiny):
    llm, _ = tiny
    together = llm.generate(PROMPTS, greedy())          # max_num_seqs=2: admitted in waves
    alone = [llm.generate(p, greedy())[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks       # every block returned


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    llm, _ = tiny
    p = gd.SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    a = llm.generate(["hello there"], p)[0].outputs[0].token_ids
    b = llm.generate(["the theme", "hello there"], [greedy(), p])[1].outputs[0].token_ids
    assert a == b
    others = {tuple(llm.generate(["hello there"], p.model_copy(update={"seed": s}))[0].outputs[0].token_ids) for s in range(4)}
    assert len(others) > 1                 # seeds matter: the draws are not all greedy
    assert llm.generate(["hello there"], gd.SamplingParams(max_tokens=12, temperature=1.0, top_k=1,
                                                          ignore_eos=True))[0].outputs[0].token_ids == \
        llm.generate(["hello there"], greedy())[0].outputs[0].token_ids


def test_repetition_penalty_matches_transformers(tiny):
    llm, hf_model = tiny
    import torch
    ids = llm.tokenizer.encode("hello there")
    ours = llm.generate([ids], greedy(16, repetition_penalty=1.5))[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                                eos_token_id=None, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours == ref[0, len(ids):].tolist()
    assert ours != llm.generate([ids], greedy(16))[0].outputs[0].token_ids


def test_stop_token_ids_and_eos(tiny):
    llm, _ = tiny
    base = llm.generate(["hello there"], greedy())[0].outputs[0].token_ids
    stop = base[3]
    cut = base.index(stop) + 1
    out = llm.generate(["hello there"], greedy(stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == base[:cut] and out.finish_reason == "stop"
    saved = set(llm.eos_token_ids)
    try:
        llm.eos_token_ids = {stop}
        assert llm.generate(["hello there"], gd.SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids == base[:cut]
        assert llm.generate(["hello there"], greedy())[0].outputs[0].token_ids == base       # ignore_eos
    finally:
        llm.eos_token_ids = saved


def test_stop_strings_truncate_text(tiny):
    llm, _ = tiny
    full = llm.generate(["hello there"], greedy(16))[0].outputs[0]
    assert full.finish_reason == "length" and full.text == llm.tokenizer.decode(full.token_ids)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    out = llm.generate(["hello there"], greedy(16, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert full.text.startswith(out.text) and len(out.text) == full.text.index(stop)


def test_stream_yields_the_generated_text(tiny):
    llm, _ = tiny
    pieces = list(llm.stream("hello there", greedy(10)))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate(["hello there"], greedy(10))[0].outputs[0].text


def test_stream_never_emits_a_stop_string(tiny):
    llm, _ = tiny
    full = llm.generate(["hello there"], greedy(16))[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    pieces = list(llm.stream("hello there", greedy(16, stop=[stop])))
    assert "".join(pieces) == full[: full.index(stop)]


def _hf_logits(hf_model, ids):
    import torch
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_logprobs_match_hf_log_softmax(tiny):
    import torch
    llm, hf_model = tiny
    ids = llm.tokenizer.encode("hello there")
    res = llm.generate([ids], greedy(8, logprobs=4, prompt_logprobs=3))[0]
    out = res.outputs[0]
    ref = torch.log_softmax(_hf_logits(hf_model, ids + out.token_ids), dim=-1)
    assert len(out.logprobs) == 8
    cum = 0.0
    for i, (tok, pos) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert set(row.topk(4).indices.tolist()) <= set(pos) and len(pos) in (4, 5)
        for t, lp in pos.items():
            assert abs(lp.logprob - float(row[t])) <= 1e-4 and lp.rank == 1 + int((row > row[t]).sum())
            assert lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
        assert pos[tok].rank == 1                                   # greedy picks the top token
        cum += pos[tok].logprob
    assert out.cumulative_logprob == pytest.approx(cum, abs=1e-5)
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(ids)
    for j in range(1, len(ids)):
        pos = res.prompt_logprobs[j]
        assert ids[j] in pos and abs(pos[ids[j]].logprob - float(ref[j - 1, ids[j]])) <= 1e-4


def test_parallel_samples_differ_and_sample_zero_is_the_seeded_request(tiny):
    llm, _ = tiny
    p = gd.SamplingParams(max_tokens=10, temperature=1.2, seed=11, n=3, ignore_eos=True)
    res = llm.generate(["hello there"], p)[0]
    assert [o.index for o in res.outputs] == [0, 1, 2]
    toks = [o.token_ids for o in res.outputs]
    assert len({tuple(t) for t in toks}) == 3
    for i in range(3):
        alone = llm.generate(["hello there"], p.model_copy(update={"n": 1, "seed": 11 + i}))[0].outputs[0]
        assert alone.token_ids == toks[i]
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks


def test_openai_penalties_match_a_reference_loop(tiny):
    """Greedy decoding with presence/frequency penalties equals a host loop over HF logits that
    subtracts frequency * count + presence * [count > 0] of the generated tokens (OpenAI/vLLM)."""
    import torch
    llm, hf_model = tiny
    ids = llm.tokenizer.encode("the theme")
    # negative penalties reward repeats: greedy output (which never repeats here) must change
    ours = llm.generate([ids], greedy(12, presence_penalty=-1.5, frequency_penalty=-0.8))[0].outputs[0].token_ids
    out = []
    for _ in range(12):
        logits = _hf_logits(hf_model, ids + out)[-1]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float() if out \
            else torch.zeros_like(logits)
        logits = logits + 0.8 * counts + 1.5 * (counts > 0).float()
        out.append(int(logits.argmax()))
    assert ours == out
    assert ours != llm.generate([ids], greedy(12))[0].outputs[0].token_ids


def test_min_tokens_holds_back_stop_ids(tiny):
    """A stop token id is banned until min_tokens tokens exist, then ends the request."""
    llm, hf_model = tiny
    ids = llm.tokenizer.encode("hello there")
    stop = llm.generate([ids], greedy())[0].outputs[0].token_ids[0]       # the greedy first token
    out = llm.generate([ids], gd.SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop],
                                                min_tokens=4))[0].outputs[0]
    ref = []
    while len(ref) < 12:
        logits = _hf_logits(hf_model, ids + ref)[-1]
        if len(ref) < 4:
            logits[stop] = float("-inf")
        ref.append(int(logits.argmax()))
        if ref[-1] == stop:
            break
    assert out.token_ids == ref and stop not in out.token_ids[:4]
    assert out.finish_reason == ("stop" if ref[-1] == stop else "length")
    assert out.stop_reason == (stop if ref[-1] == stop else None)
