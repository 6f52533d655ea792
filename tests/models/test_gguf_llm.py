"""A tiny Llama written as GGUF with the ``gguf`` package (llama.cpp naming, q/k permutation, F16
matrices, a byte-level BPE vocabulary and a chat template) must score and greedy-decode like the
transformers model it came from, with its config and tokenizer read from the GGUF metadata."""
import pytest

import graphdsl as gd
from tests.models.gguf_tiny import build_tiny_gguf, vocabulary
from tests.models.hf_tiny import hf_greedy, hf_logits


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return build_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def test_gguf_parity_with_transformers(tiny_gguf):
    path, hf_model = tiny_gguf
    llm = gd.LLM(str(path), device="cpu", max_model_len=96)
    assert llm.config.num_hidden_layers == 2 and llm.config.vocab_size == len(vocabulary())
    ids = llm.tokenizer.encode("hello there, the theme")
    assert ids and llm.tokenizer.decode(ids) == "hello there, the theme"
    ours, ref = llm.score(ids), hf_logits(hf_model, ids)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    out = llm.generate(["hello there, the theme", "he"], gd.SamplingParams(max_tokens=32, temperature=0,
                                                                           ignore_eos=True))
    out = [o.outputs[0] for o in out]
    assert out[0].token_ids == hf_greedy(hf_model, ids, 32)
    assert out[1].token_ids == hf_greedy(hf_model, llm.tokenizer.encode("he"), 32)
    assert out[0].text == llm.tokenizer.decode(out[0].token_ids)


def test_gguf_chat_template_and_eos(tiny_gguf):
    path, _ = tiny_gguf
    llm = gd.LLM(str(path), device="cpu", max_model_len=96)
    eos = vocabulary().index("<|im_end|>")
    assert eos in llm.eos_token_ids
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    res = llm.generate("hi", gd.SamplingParams(max_tokens=8, temperature=0), use_chat_template=True)[0]
    out = res.outputs[0]
    assert res.prompt_token_ids[:1] == [vocabulary().index("<|im_start|>")]
    assert out.finish_reason in ("stop", "length") and 1 <= len(out.token_ids) <= 8
