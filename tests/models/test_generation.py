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
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks       # every block returned


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    llm, _ = tiny
    p = gd.SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    a = llm.generate(["hello there"], p)[0].token_ids
    b = llm.generate(["the theme", "hello there"], [greedy(), p])[1].token_ids
    assert a == b
    others = {tuple(llm.generate(["hello there"], p.model_copy(update={"seed": s}))[0].token_ids) for s in range(4)}
    assert len(others) > 1                 # seeds matter: the draws are not all greedy
    assert llm.generate(["hello there"], gd.SamplingParams(max_tokens=12, temperature=1.0, top_k=1,
                                                          ignore_eos=True))[0].token_ids == \
        llm.generate(["hello there"], greedy())[0].token_ids


def test_repetition_penalty_matches_transformers(tiny):
    llm, hf_model = tiny
    import torch
    ids = llm.tokenizer.encode("hello there")
    ours = llm.generate([ids], greedy(16, repetition_penalty=1.5))[0].token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                                eos_token_id=None, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours == ref[0, len(ids):].tolist()
    assert ours != llm.generate([ids], greedy(16))[0].token_ids


def test_stop_token_ids_and_eos(tiny):
    llm, _ = tiny
    base = llm.generate(["hello there"], greedy())[0].token_ids
    stop = base[3]
    cut = base.index(stop) + 1
    out = llm.generate(["hello there"], greedy(stop_token_ids=[stop]))[0]
    assert out.token_ids == base[:cut] and out.finish_reason == "stop"
    saved = set(llm.eos_token_ids)
    try:
        llm.eos_token_ids = {stop}
        assert llm.generate(["hello there"], gd.SamplingParams(max_tokens=12, temperature=0))[0].token_ids == base[:cut]
        assert llm.generate(["hello there"], greedy())[0].token_ids == base       # ignore_eos
    finally:
        llm.eos_token_ids = saved


def test_stop_strings_truncate_text(tiny):
    llm, _ = tiny
    full = llm.generate(["hello there"], greedy(16))[0]
    assert full.finish_reason == "length" and full.text == llm.tokenizer.decode(full.token_ids)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    out = llm.generate(["hello there"], greedy(16, stop=[stop]))[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert full.text.startswith(out.text) and len(out.text) == full.text.index(stop)


def test_stream_yields_the_generated_text(tiny):
    llm, _ = tiny
    pieces = list(llm.stream("hello there", greedy(10)))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate(["hello there"], greedy(10))[0].text


def test_stream_never_emits_a_stop_string(tiny):
    llm, _ = tiny
    full = llm.generate(["hello there"], greedy(16))[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    pieces = list(llm.stream("hello there", greedy(16, stop=[stop])))
    assert "".join(pieces) == full[: full.index(stop)]
