"""Write a tiny Llama as a GGUF file with the ``gguf`` package, the way llama.cpp's converter does:
llama.cpp tensor names, q/k rows permuted, F16 matrices, a byte-level BPE vocabulary, a chat template."""
import numpy as np
import torch

from tests.models.hf_tiny import make_checkpoint

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


def write_llama_gguf(path, hf_model, metadata=None):
    """``metadata``: extra or replacement keys (str, int or float values)."""
    import gguf
    cfg = hf_model.config
    tokens = vocabulary()
    assert len(tokens) == cfg.vocab_size
    w = _Overridden(gguf.GGUFWriter(str(path), "llama"), dict(metadata or {}))
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
    w.add_rest()
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


class _Overridden:
    """A GGUFWriter whose scalar keys take their value from ``overrides`` where given; ``add_rest``
    writes the override keys the writer was never asked for (typed by their Python type)."""

    def __init__(self, writer, overrides: dict):
        self._w, self._over = writer, overrides

    def __getattr__(self, name):
        fn = getattr(self._w, name)
        if name not in ("add_string", "add_uint32", "add_float32"):
            return fn
        return lambda key, value: fn(key, self._over.pop(key, value))

    def add_rest(self):
        adders = {str: self._w.add_string, float: self._w.add_float32, int: self._w.add_uint32}
        for key, value in self._over.items():
            adders[type(value)](key, value)
        self._over = {}


def build_tiny_gguf(directory, **metadata):
    """``(path of tiny.gguf, the transformers model it holds)``; matrices pass through float16 on
    both sides so the two hold identical values. Keyword arguments replace or add metadata keys
    (``tokenizer_model="x"`` for ``tokenizer.ggml.model``, or a full key through ``**{"a.b": v}``)."""
    hf_model = make_checkpoint("llama", directory / "hf", vocab_size=len(vocabulary()))
    with torch.no_grad():
        for p in hf_model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    keys = {("tokenizer.ggml.model" if k == "tokenizer_model" else k): v for k, v in metadata.items()}
    write_llama_gguf(directory / "tiny.gguf", hf_model, keys)
    return directory / "tiny.gguf", hf_model
