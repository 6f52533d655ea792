"""A tiny Llama written as GGUF with the ``gguf`` package (llama.cpp naming, q/k permutation, F16
matrices, a byte-level BPE vocabulary and a chat template) must score and greedy-decode like the
transformers model it came from, with its config and tokenizer read from the GGUF metadata."""
import numpy as np
import pytest
import torch

import graphdsl as gd
from tests.models.hf_tiny import hf_greedy, hf_logits, make_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def vocabulary() -> list[str]:
    return byte_level_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS


def permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order: each head's half-split rotary rows become interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_llama_gguf(path, hf_model):
    import gguf
    cfg = hf_model.config
    tokens = vocabulary()
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.context_length", cfg.max_position_embeddings)
    w.add_uint32("llama.embedding_length", cfg.hidden_size)
    w.add_uint32("llama.block_count", cfg.num_hidden_layers)
    w.add_uint32("llama.feed_forward_length", cfg.intermediate_size)
    w.add_uint32("llama.attention.head_count", cfg.num_attention_heads)
    w.add_uint32("llama.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32("llama.rope.dimension_count", cfg.hidden_size // cfg.num_attention_heads)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32("llama.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_array("tokenizer.ggml.merges", MERGES)
    w.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"))
    w.add_uint32("tokenizer.ggml.bos_token_id", tokens.index("<|endoftext|>"))
    w.add_string("tokenizer.chat_template", TEMPLATE)
    for name, p in hf_model.state_dict().items():
        a = p.detach().float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        else:
            _, _, i, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            gname = f"blk.{i}.{LAYER_NAMES[module]}.{leaf}"
            if module == "self_attn.q_proj":
                a = permute_for_llama_cpp(a, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = permute_for_llama_cpp(a, cfg.num_key_value_heads)
        w.add_tensor(gname, a.astype(np.float16) if a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    hf_model = make_checkpoint("llama", d / "hf", vocab_size=len(vocabulary()))
    with torch.no_grad():      # the GGUF stores matrices in float16: give HF the same values
        for p in hf_model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    write_llama_gguf(d / "tiny.gguf", hf_model)
    return d / "tiny.gguf", hf_model


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
    out = llm.generate("hi", gd.SamplingParams(max_tokens=8, temperature=0), use_chat_template=True)[0]
    assert out.prompt_token_ids[:1] == [vocabulary().index("<|im_start|>")]
    assert out.finish_reason in ("stop", "length") and 1 <= len(out.token_ids) <= 8
