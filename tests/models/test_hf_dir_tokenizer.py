"""A HF directory with tokenizer.json + tokenizer_config.json (chat template): text prompts, chat
and eos come from it, and text generation equals generation from the same token ids."""
import graphdsl as gd
from tests.models.gguf_tiny import MERGES, SPECIALS, TEMPLATE, vocabulary
from tests.models.hf_tiny import hf_greedy, make_checkpoint


def save_tokenizer(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(vocabulary())}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in MERGES]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    return tok


def test_text_prompts_and_chat_from_a_hf_directory(tmp_path):
    hf_model = make_checkpoint("qwen2", tmp_path, vocab_size=len(vocabulary()))
    hf_tok = save_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    llm = gd.LLM(tmp_path, device="cpu", max_model_len=64)
    assert vocabulary().index("<|im_end|>") in llm.eos_token_ids
    ids = hf_tok.encode("hello there, the theme")
    assert llm.tokenizer.encode("hello there, the theme") == ids
    p = gd.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    res = llm.generate("hello there, the theme", p)[0]
    out = res.outputs[0]
    assert res.prompt_token_ids == ids and out.token_ids == hf_greedy(hf_model, ids, 16)
    assert out.text == hf_tok.decode(out.token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "hi"}], gd.SamplingParams(max_tokens=6, temperature=0))
    want = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.prompt == want
