"""Write tiny GGUF files the way llama.cpp's converter would, for loader tests.

Independent of ``graphdsl.runtime.loaders.gguf``: its own HF → llama.cpp name table and its own forward
q/k permutation, so a loader bug cannot cancel against a helper bug.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

# HF suffix -> llama.cpp suffix, inside model.layers.{i}.
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# gemma2 has four norms a layer: llama.cpp's ffn_norm is the one before the MLP there
_GEMMA2 = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    table = {**_LAYER, **_GEMMA2} if arch == "gemma2" else _LAYER
    assert m and m.group(2) in table, hf
    return f"blk.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows (half-split rotary order) → interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_metadata(writer, meta: dict[str, Any]) -> None:
    from gguf import GGUFValueType as V
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], float):
            writer.add_key_value(key, value, V.ARRAY, sub_type=V.FLOAT32)
        elif isinstance(value, list) and value and isinstance(value[0], int):
            writer.add_key_value(key, value, V.ARRAY, sub_type=V.INT32)
        else:
            writer.add_array(key, value)


def write_gguf(path, arch: str, meta: dict[str, Any], tensors: dict[str, tuple[np.ndarray, Any]]) -> None:
    """``tensors``: GGUF name -> (numpy data, GGMLQuantizationType or None for the array's dtype)."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), arch)
    add_metadata(w, meta)
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_model_to_gguf(path, model, arch: str, *, quant: dict[str, Any] | None = None,
                     tokenizer_meta: dict[str, Any] | None = None, extra_meta: dict | None = None,
                     skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write ``model`` (a HF *ForCausalLM) as llama.cpp would; returns the HF state dict written.

    ``quant`` maps a regex over HF names to a GGMLQuantizationType (first match wins; default F32);
    transformers' fused expert stacks match as ``model.layers.{i}.mlp.experts.gate_up_proj`` (gate and
    up both) and ``...down_proj``.
    q/k weights are permuted for the ``llama`` architecture only, and Gemma's norm weights stored
    as ``1 + w``, as llama.cpp does.
    """
    from gguf import quants
    cfg = model.config
    meta = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": float(getattr(cfg, "rope_theta", None)
                                        or cfg.rope_parameters["rope_theta"]),
    }
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    meta[f"{arch}.rope.dimension_count"] = head_dim
    if arch != "llama":
        meta[f"{arch}.attention.key_length"] = head_dim
        meta[f"{arch}.attention.value_length"] = head_dim
    meta.update(tokenizer_meta or {})
    meta.update(extra_meta or {})
    if getattr(cfg, "num_experts", None):
        meta[f"{arch}.expert_count"] = cfg.num_experts
        meta[f"{arch}.expert_used_count"] = cfg.num_experts_per_tok
        if getattr(cfg, "moe_intermediate_size", None):     # Mixtral's experts are intermediate_size wide
            meta[f"{arch}.expert_feed_forward_length"] = cfg.moe_intermediate_size
        if getattr(cfg, "shared_expert_intermediate_size", None):
            meta[f"{arch}.expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    if arch == "gemma2":
        meta.update({f"{arch}.attn_logit_softcapping": float(cfg.attn_logit_softcapping),
                     f"{arch}.final_logit_softcapping": float(cfg.final_logit_softcapping),
                     f"{arch}.attention.sliding_window": cfg.sliding_window})
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    tensors = {}
    for name, t in sd.items():
        if name in skip:
            continue
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:  # transformers' fused experts [E, 2I, H] (gate rows first) / [E, H, I]
            blk = f"blk.{m.group(1)}"
            qtype = next((q for pat, q in (quant or {}).items() if re.search(pat, name)), None)

            def stored(a: torch.Tensor):
                data = np.ascontiguousarray(a.contiguous().numpy(), dtype=np.float32)
                return (data, None) if qtype is None else (quants.quantize(data, qtype), qtype)
            if m.group(2) == "gate_up_proj":
                gate, up = t.chunk(2, dim=1)
                tensors[f"{blk}.ffn_gate_exps.weight"] = stored(gate)
                tensors[f"{blk}.ffn_up_exps.weight"] = stored(up)
            else:
                tensors[f"{blk}.ffn_down_exps.weight"] = stored(t)
            continue
        data = t.numpy()
        if name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)                      # llama.cpp stores it 1-D
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        if arch in ("gemma", "gemma2") and name.endswith("norm.weight"):
            data = data + 1.0
        qtype = next((q for pat, q in (quant or {}).items() if re.search(pat, name)), None)
        gname = gguf_name(name, arch)
        if qtype is None:
            tensors[gname] = (np.ascontiguousarray(data, dtype=np.float32), None)
        else:
            tensors[gname] = (quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), qtype)
    write_gguf(path, arch, meta, tensors)
    return sd


_BLOOM_LAYER = {"input_layernorm": "attn_norm", "self_attention.query_key_value": "attn_qkv",
                "self_attention.dense": "attn_output", "post_attention_layernorm": "ffn_norm",
                "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
_BLOOM_GLOBAL = {"word_embeddings": "token_embd", "word_embeddings_layernorm": "token_embd_norm", "ln_f": "output_norm"}


def bloom_to_gguf(path, model, *, tokenizer_meta: dict[str, Any] | None = None) -> None:
    """Write a HF Bloom as llama.cpp's converter does: the fused q/k/v rows reordered from per head
    ``[head, (q|k|v), head_dim]`` to ``[q | k | v]``, and the embedding written again as ``output``."""
    cfg = model.config
    h, n = cfg.n_head, cfg.hidden_size
    meta = {"bloom.context_length": n, "bloom.embedding_length": n, "bloom.feed_forward_length": 4 * n,
            "bloom.block_count": cfg.n_layer, "bloom.attention.head_count": h, "bloom.attention.head_count_kv": h,
            "bloom.attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon)}
    meta.update(tokenizer_meta or {})
    tensors = {}
    for name, t in model.state_dict().items():
        name = re.sub(r"^transformer\.", "", name)
        data = t.detach().float().numpy()
        m = re.match(r"h\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m:
            if m.group(2) == "self_attention.query_key_value":
                data = data.reshape(h, 3, n // h, *data.shape[1:]).swapaxes(0, 1).reshape(data.shape)
            gname = f"blk.{m.group(1)}.{_BLOOM_LAYER[m.group(2)]}.{m.group(3)}"
        elif name == "lm_head.weight":
            continue
        else:
            module, leaf = name.rsplit(".", 1)
            gname = f"{_BLOOM_GLOBAL[module]}.{leaf}"
        tensors[gname] = (np.ascontiguousarray(data, dtype=np.float32), None)
    tensors["output.weight"] = tensors["token_embd.weight"]
    write_gguf(path, "bloom", meta, tensors)


_DEEPSEEK2_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def deepseek2_to_gguf(path, model, *, tokenizer_meta: dict[str, Any] | None = None, split_kv_b: bool = True,
                      with_groups: bool = True) -> None:
    """Write a HF DeepSeek-V2/V3 as llama.cpp's ``deepseek2`` converter does: MLA as one-head MQA in the
    metadata (per-head sizes under ``*_mla``), ``kv_b_proj`` split into ``attn_k_b`` (transposed per
    head) and ``attn_v_b`` (``split_kv_b``; older files keep ``attn_kv_b``), stacked experts,
    ``e_score_correction_bias`` as ``exp_probs_b.bias``, YaRN's ``0.1 * mscale_all_dim``."""
    cfg = model.config
    a = "deepseek2"
    h, lora, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    rp = getattr(cfg, "rope_parameters", None) or {}
    sigmoid = cfg.model_type == "deepseek_v3"
    meta = {
        f"{a}.context_length": cfg.max_position_embeddings, f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.block_count": cfg.num_hidden_layers, f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": h, f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.rope.freq_base": float(rp.get("rope_theta", 10000.0)), f"{a}.vocab_size": cfg.vocab_size,
        f"{a}.leading_dense_block_count": cfg.first_k_dense_replace, f"{a}.attention.kv_lora_rank": lora,
        f"{a}.attention.key_length": lora + rope, f"{a}.attention.value_length": lora,
        f"{a}.attention.key_length_mla": nope + rope, f"{a}.attention.value_length_mla": v,
        f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size, f"{a}.expert_count": cfg.n_routed_experts,
        f"{a}.expert_shared_count": cfg.n_shared_experts, f"{a}.expert_used_count": cfg.num_experts_per_tok,
        f"{a}.expert_weights_scale": float(cfg.routed_scaling_factor),
        f"{a}.expert_gating_func": 2 if sigmoid else 1, f"{a}.rope.dimension_count": rope,
    }
    if cfg.q_lora_rank:
        meta[f"{a}.attention.q_lora_rank"] = cfg.q_lora_rank
    if getattr(cfg, "norm_topk_prob", False):
        meta[f"{a}.expert_weights_norm"] = True
    if with_groups and (cfg.n_group or 1) > 1:
        meta.update({f"{a}.expert_group_count": cfg.n_group, f"{a}.expert_group_used_count": cfg.topk_group})
    if rp.get("rope_type") == "yarn":
        meta.update({f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": float(rp["factor"]),
                     f"{a}.rope.scaling.original_context_length": rp["original_max_position_embeddings"],
                     f"{a}.rope.scaling.yarn_log_multiplier": 0.1 * rp["mscale_all_dim"]})
    meta.update(tokenizer_meta or {})
    tensors = {}
    for name, t in model.state_dict().items():
        data = t.detach().float()
        if name in _GLOBAL:
            tensors[_GLOBAL[name]] = (np.ascontiguousarray(data.numpy(), dtype=np.float32), None)
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?$", name)
        blk, part, leaf = f"blk.{m.group(1)}", m.group(2), m.group(3)
        out: dict[str, torch.Tensor] = {}
        if part == "mlp.experts.gate_up_proj":
            gate, up = data.chunk(2, dim=1)
            out = {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
        elif part == "mlp.experts.down_proj":
            out = {f"{blk}.ffn_down_exps.weight": data}
        elif part == "mlp.gate.e_score_correction_bias":
            out = {f"{blk}.exp_probs_b.bias": data}
        elif part == "self_attn.kv_b_proj" and split_kv_b:
            k_b, v_b = data.reshape(h, nope + v, lora).split([nope, v], dim=1)
            out = {f"{blk}.attn_k_b.weight": k_b.transpose(1, 2), f"{blk}.attn_v_b.weight": v_b}
        else:
            out = {f"{blk}.{_DEEPSEEK2_LAYER[part]}.{leaf}": data}
        for gname, x in out.items():
            tensors[gname] = (np.ascontiguousarray(x.numpy(), dtype=np.float32), None)
    write_gguf(path, a, meta, tensors)
