"""GGUF checkpoints: metadata → HF config, tensors → HF parameter names, block dequantization.

Reading goes through the ``gguf`` package's ``GGUFReader`` (memory-mapped); everything after the
raw bytes is ours, written in torch so the same code decodes on the CPU or on a GPU:

- :func:`dequantize` turns the raw block bytes of one tensor into float32 (formats below);
- :class:`GGUFCheckpoint` renames llama.cpp tensors to HF names (splitting stacked MoE experts
  into per-expert tensors), undoes the q/k row permutation
  llama.cpp's converter applies to llama-architecture attention weights (and the ``+ 1`` it adds
  to Gemma's norm weights, and its ``[q | k | v]`` order of Bloom's fused projection), builds a HF
  ``config.json``-style dict from the ``{arch}.*`` metadata, and a :class:`Tokenizer` from
  ``tokenizer.*``; with ``iter_tensors(keep_quantized=True)`` it keeps the linear weights of the
  block types the GGUF kernels run as :class:`GGUFBlockWeight` records (raw rows, type, shape).

Block formats: :mod:`graphdsl.runtime.gguf_blocks`.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.gguf_blocks import (GGUF_BLOCKS, KERNEL_QTYPES, GGUFBlockWeight, dequantize_blocks,
                                          row_bytes)

from .tokenizer import Tokenizer

__all__ = ["GGUFCheckpoint", "GGUFBlockWeight", "dequantize", "SUPPORTED_QTYPES", "KEPT_QTYPES",
           "SUPPORTED_ARCHITECTURES"]


def _qtype_enum():
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType


_BLOCKS = GGUF_BLOCKS
SUPPORTED_QTYPES = tuple(GGUF_BLOCKS)
# block types ``iter_tensors(keep_quantized=True)`` keeps as blocks: those with GGUF kernels
KEPT_QTYPES = tuple(KERNEL_QTYPES)


def _qtype_name(qtype) -> str:
    enum = _qtype_enum()
    try:
        return enum(int(qtype)).name if not isinstance(qtype, str) else enum[qtype].name
    except (ValueError, KeyError):
        raise GraphDSLError(f"unknown GGML tensor type {qtype!r}") from None


def dequantize(data, qtype, shape, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Raw GGML bytes of one tensor → float32 torch tensor of ``shape`` (numpy/HF order).

    ``data``: a numpy array or torch tensor holding the tensor's bytes (uint8 block bytes, or
    the typed array the reader returns for F32/F16); ``qtype``: a ``GGMLQuantizationType``, its
    int or name. ``device``: where to decode (the raw bytes are copied there first, so a CUDA
    device moves the small quantized bytes, not float32 weights); default: the CPU.
    """
    name = _qtype_name(qtype)
    if name not in _BLOCKS:
        raise GraphDSLError(f"GGML tensor type {name} is not supported; supported: "
                            f"{list(SUPPORTED_QTYPES)}")
    shape = tuple(int(s) for s in shape)
    numel = int(np.prod(shape)) if shape else 1
    per_block, nbytes = _BLOCKS[name]
    if numel % per_block:
        raise GraphDSLError(f"{name} tensor of shape {list(shape)} ({numel} values) is not a "
                            f"whole number of {per_block}-value blocks")
    if isinstance(data, torch.Tensor):
        raw = data.detach().contiguous().reshape(-1).view(torch.uint8)
    else:
        with warnings.catch_warnings():  # a read-only memory map: we only ever read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    want = numel // per_block * nbytes
    if raw.numel() != want:
        raise GraphDSLError(f"{name} tensor of shape {list(shape)} needs {want} bytes, "
                            f"got {raw.numel()}")
    if device is not None:
        raw = raw.to(device)
    rows = numel // shape[-1] if shape and shape[-1] % per_block == 0 else 1   # GGUF rows hold whole blocks
    out = dequantize_blocks(raw.reshape(rows, -1), name, numel // rows)
    return out.reshape(shape)


# --------------------------------------------------------------------------- architectures

# GGUF architecture -> (HF model_type, HF architectures class)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "bloom": ("bloom", "BloomForCausalLM"),
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
}
_MOE = ("qwen2moe", "qwen3moe")
SUPPORTED_ARCHITECTURES = tuple(_ARCHS)
# llama.cpp permutes q/k rows for these (its rotary embedding is interleaved; HF's is half-split)
_PERMUTED_QK = ("llama",)
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (HF keeps w)
_NORM_PLUS_ONE = ("gemma", "gemma2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "token_embd_norm.weight": "model.embed_layernorm.weight",   # bloom
    "token_embd_norm.bias": "model.embed_layernorm.bias",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",                       # MoE router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",   # stored 1-D [hidden]; HF has [1, hidden]
    "post_attention_norm": "post_attention_layernorm",   # gemma2: the norm after attention
    "post_ffw_norm": "post_feedforward_layernorm",
}
# architectures whose layers use a name differently (gemma2's ffn_norm is the norm before the MLP)
_ARCH_LAYER_NAMES = {"gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
                     # llama.cpp stores bloom's fused q/k/v as [q | k | v]; it is yielded in the HF layout
                     "bloom": {"attn_qkv": "self_attention.query_key_value"},
                     # multi-head latent attention; llama.cpp names DeepSeek's shared experts like Qwen's
                     "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                                   "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                                   "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                                   "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                                   "ffn_up_shexp": "mlp.shared_experts.up_proj",
                                   "ffn_down_shexp": "mlp.shared_experts.down_proj"}}
# stacked experts [E, ...] -> one HF tensor per expert: mlp.experts.{e}.{proj}.weight
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def _expert_name(layer: str, e: int, part: str) -> str:
    """The HF name of expert ``e``'s matrix of a stacked ``ffn_{gate,up,down}_exps`` tensor ``part``."""
    return f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[part]}.weight"


_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# rewritten on load beyond whole rows (transposed and joined): always dequantized
_NOT_KEPT = ("attn_k_b", "attn_v_b")
# tensors llama.cpp writes that are not parameters of the HF model (rope_freqs: llama3 scaling)
_SKIPPED = ("rope_freqs.weight",)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name of a llama.cpp tensor name in ``arch`` (None if it has no mapping)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: rows of each head go from interleaved pairs
    ``(0, d/2, 1, d/2+1, ...)`` back to HF's half-split order."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GraphDSLError(f"cannot un-permute a q/k weight of {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _per_head_qkv(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``[q | k | v]`` rows (or bias) back to Bloom's per-head ``[head, (q | k | v), head_dim]``."""
    rows = w.shape[0]
    return w.reshape(3, n_head, rows // 3 // n_head, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


class GGUFCheckpoint:
    """A GGUF file: metadata, HF-style config, HF-named dequantized tensors, tokenizer."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GraphDSLError(f"GGUF file {self.path!r} does not exist")
        from gguf import GGUFReader
        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # bad magic, version, truncated header/tensor infos/data, ...
            size = os.path.getsize(self.path)
            why = _first_line(e)
            hint = "" if "magic" in why else f" (truncated or corrupt? the file has {size} bytes)"
            raise GraphDSLError(f"{self.path!r} is not a readable GGUF file{hint}: "
                                f"{type(e).__name__}: {why}") from None
        try:
            self.metadata: dict[str, Any] = {k: _plain(f.contents())
                                             for k, f in self._reader.fields.items()}
        except Exception as e:
            raise GraphDSLError(f"{self.path!r}: cannot decode GGUF metadata: {_first_line(e)}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    def __repr__(self) -> str:
        return (f"GGUFCheckpoint({self.path!r}, architecture={self.metadata.get('general.architecture')!r}, "
                f"{len(self._tensors)} tensors)")

    # ------------------------------------------------------------------ metadata
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GraphDSLError(f"{self.path!r} has no general.architecture metadata")
        return arch

    @property
    def tensor_names(self) -> list[str]:
        """The file's own (llama.cpp) tensor names."""
        return list(self._tensors)

    def tensor_info(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{gguf name: (GGML type name, numpy-order shape)}``."""
        return {n: (t.tensor_type.name, tuple(int(s) for s in reversed(t.shape.tolist())))
                for n, t in self._tensors.items()}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{HF name: shape}`` of every tensor :meth:`iter_tensors` yields, from the headers alone
        (no tensor is read): stacked experts ``[E, ...]`` as each expert's, DeepSeek's ``attn_k_b`` /
        ``attn_v_b`` halves as the ``kv_b_proj`` they join into, llama.cpp's 1-D shared-expert gate as
        ``[1, hidden]``; names without an HF mapping stay as they are (``graphdsl check`` reports them)."""
        arch = self._check_arch()
        out: dict[str, tuple[int, ...]] = {}
        halves: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, (_, shape) in self.tensor_info().items():
            if name in _SKIPPED:
                continue
            m = _LAYER_RE.match(name)
            part = m.group(2) if m else None
            if part in _EXPERT_NAMES and len(shape) == 3:
                out.update((_expert_name(m.group(1), e, part), shape[1:]) for e in range(shape[0]))
            elif part in ("attn_k_b", "attn_v_b"):
                pair = halves.setdefault(m.group(1), {})
                pair[part] = shape
                if len(pair) == 2:      # [heads, rank, nope] and [heads, v, rank] -> [heads * (nope + v), rank]
                    k_b, v_b = pair["attn_k_b"], pair["attn_v_b"]
                    out[f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight"] = (k_b[0] * (k_b[2] + v_b[1]),
                                                                                   k_b[1])
            elif part == "exp_probs_b":
                out[f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"] = shape
            elif part == "ffn_gate_inp_shexp" and len(shape) == 1:
                out[hf_name(name, arch) or name] = (1, shape[0])
            else:
                out[hf_name(name, arch) or name] = shape
        return out

    def block_types(self) -> dict[str, str]:
        """``{HF name: GGML type name}`` of the 2-D weights that map one to one onto an HF tensor,
        and of each expert of a stacked expert tensor (``model.layers.{i}.mlp.experts.{e}.{proj}.weight``,
        as :meth:`iter_tensors` names them): what ``iter_tensors(keep_quantized=True)`` yields as
        :class:`GGUFBlockWeight` when the type is in :data:`KEPT_QTYPES` (joined halves are not listed)."""
        arch = self._check_arch()
        out = {}
        for name, t in self._tensors.items():
            m = _LAYER_RE.match(name)
            if m and m.group(2) in _EXPERT_NAMES and len(t.shape) == 3:
                out.update((_expert_name(m.group(1), e, m.group(2)), t.tensor_type.name)
                           for e in range(int(t.shape[2])))
                continue
            if len(t.shape) != 2 or (m and m.group(2) in _NOT_KEPT) or name == "token_embd.weight":
                continue
            hf = hf_name(name, arch)
            if hf is not None:
                out[hf] = t.tensor_type.name
        return out

    def _check_arch(self) -> str:
        arch = self.architecture
        if arch not in _ARCHS:
            raise GraphDSLError(f"{self.path!r}: GGUF architecture {arch!r} is not supported; "
                                f"supported: {list(SUPPORTED_ARCHITECTURES)}")
        return arch

    def _key(self, arch: str, key: str, default: Any = ...) -> Any:
        v = self.metadata.get(f"{arch}.{key}", default)
        if v is ...:
            raise GraphDSLError(f"{self.path!r}: required metadata key '{arch}.{key}' is missing")
        return v

    def hf_config(self) -> dict[str, Any]:
        """A HF ``config.json``-style dict for this file (llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma,
        gemma2, bloom, deepseek2; a llama with ``expert_count`` is Mixtral)."""
        arch = self._check_arch()
        model_type, cls = _ARCHS[arch]
        mixtral = arch == "llama" and self._key(arch, "expert_count", None) is not None
        if mixtral:                  # llama.cpp converts Mixtral as a llama with stacked experts
            model_type, cls = "mixtral", "MixtralForCausalLM"
        hidden = int(self._key(arch, "embedding_length"))
        heads = int(self._key(arch, "attention.head_count"))
        kv_heads = int(self._key(arch, "attention.head_count_kv", heads))
        head_dim = self._key(arch, "attention.key_length", None)
        if head_dim is None and arch in _PERMUTED_QK:
            head_dim = self._key(arch, "rope.dimension_count", None)
        if head_dim is None:
            head_dim = hidden // heads
        vocab = self._key(arch, "vocab_size", None)
        if vocab is None and "token_embd.weight" in self._tensors:
            vocab = self.tensor_info()["token_embd.weight"][1][0]
        if vocab is None:
            vocab = len(self.metadata.get("tokenizer.ggml.tokens") or [])
        cfg: dict[str, Any] = {
            "model_type": model_type,
            "architectures": [cls],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._key(arch, "feed_forward_length")),
            "num_hidden_layers": int(self._key(arch, "block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": int(head_dim),
            "rms_norm_eps": float(self._key(arch, "attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._key(arch, "rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._key(arch, "context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }
        if self.metadata.get("tokenizer.ggml.padding_token_id") is not None:
            cfg["pad_token_id"] = self.metadata["tokenizer.ggml.padding_token_id"]
        if arch in _MOE:
            experts = int(self._key(arch, "expert_count"))
            moe_ff = int(self._key(arch, "expert_feed_forward_length"))
            dense = [i for i in range(cfg["num_hidden_layers"])
                     if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors]
            cfg.update(num_experts=experts,
                       num_experts_per_tok=int(self._key(arch, "expert_used_count")),
                       moe_intermediate_size=moe_ff, decoder_sparse_step=1, mlp_only_layers=dense,
                       # llama.cpp renormalises the top-k weights for qwen3moe, not for qwen2moe
                       norm_topk_prob=arch == "qwen3moe")
            shared = self._key(arch, "expert_shared_feed_forward_length", None)
            if shared is not None:
                cfg["shared_expert_intermediate_size"] = int(shared)
        if arch == "deepseek2":
            self._deepseek2_fields(cfg)
        if arch == "bloom":
            cfg["layer_norm_epsilon"] = float(self._key(arch, "attention.layer_norm_epsilon"))
        if arch == "gemma2":
            window = self._key(arch, "attention.sliding_window", None)
            cfg.update(attn_logit_softcapping=self._key(arch, "attn_logit_softcapping", None),
                       final_logit_softcapping=self._key(arch, "final_logit_softcapping", None),
                       sliding_window=None if window is None else int(window),
                       # not in the metadata: llama.cpp scales q by 1/sqrt(head_dim), by 1/sqrt(hidden / heads)
                       # for the 46-layer 27B
                       query_pre_attn_scalar=hidden // heads if cfg["num_hidden_layers"] == 46 else int(head_dim))
        if mixtral:
            cfg.update(num_local_experts=int(self._key(arch, "expert_count")),
                       num_experts_per_tok=int(self._key(arch, "expert_used_count")))
        if arch == "llama":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
            cfg["mlp_bias"] = "blk.0.ffn_up.bias" in self._tensors
        scaling = self._key(arch, "rope.scaling.type", None)
        if scaling not in (None, "none"):
            rs: dict[str, Any] = {"rope_type": scaling}
            factor = self._key(arch, "rope.scaling.factor", None)
            if factor is not None:
                rs["factor"] = float(factor)
            orig = self._key(arch, "rope.scaling.original_context_length", None)
            if orig is not None:
                rs["original_max_position_embeddings"] = int(orig)
            if arch == "deepseek2":
                # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs have mscale == mscale_all_dim
                log_mul = self._key(arch, "rope.scaling.yarn_log_multiplier", None)
                if log_mul:
                    rs.update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
                rs.update(beta_fast=32.0, beta_slow=1.0)
            cfg["rope_scaling"] = rs
        return cfg

    def _deepseek2_fields(self, cfg: dict[str, Any]) -> None:
        """Add DeepSeek-V2/V3 fields from llama.cpp's ``deepseek2`` metadata to ``cfg``.

        llama.cpp describes MLA as one-head MQA over the latent (``key_length`` = kv_lora_rank +
        rope dims, ``value_length`` = kv_lora_rank) and keeps the per-head sizes in ``key_length_mla``
        / ``value_length_mla``; files written before that split hold the per-head sizes in
        ``key_length`` / ``value_length``. Routing: sigmoid gating is V3's ``noaux_tc``; softmax over
        more than one expert group is V2's ``group_limited_greedy``.
        """
        a = "deepseek2"
        rope = int(self._key(a, "rope.dimension_count"))
        mla = self._key(a, "attention.key_length_mla", None) is not None
        qk = int(self._key(a, "attention.key_length_mla" if mla else "attention.key_length"))
        v = int(self._key(a, "attention.value_length_mla" if mla else "attention.value_length"))
        q_lora = self._key(a, "attention.q_lora_rank", None)
        experts = int(self._key(a, "expert_count", 0) or 0)
        groups = int(self._key(a, "expert_group_count", 1) or 1)
        sigmoid = int(self._key(a, "expert_gating_func", 1) or 1) == 2   # llama.cpp: 1 softmax, 2 sigmoid
        if sigmoid:
            cfg["model_type"], cfg["architectures"] = "deepseek_v3", ["DeepseekV3ForCausalLM"]
        cfg.pop("head_dim", None)
        cfg.update({
            "num_key_value_heads": cfg["num_attention_heads"],   # the HF config's (MLA expands per head)
            "kv_lora_rank": int(self._key(a, "attention.kv_lora_rank")),
            "q_lora_rank": None if not q_lora else int(q_lora),
            "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope, "v_head_dim": v,
            "first_k_dense_replace": int(self._key(a, "leading_dense_block_count", 0)),
            "n_routed_experts": experts or None,
            "num_experts_per_tok": int(self._key(a, "expert_used_count", 0) or 0) or None,
            "moe_intermediate_size": int(self._key(a, "expert_feed_forward_length", 0) or 0) or None,
            "n_shared_experts": int(self._key(a, "expert_shared_count", 0) or 0) or None,
            "routed_scaling_factor": float(self._key(a, "expert_weights_scale", 1.0) or 1.0),
            "norm_topk_prob": bool(self._key(a, "expert_weights_norm", False)),
            "scoring_func": "sigmoid" if sigmoid else "softmax",
            "topk_method": "noaux_tc" if sigmoid else ("group_limited_greedy" if groups > 1 else "greedy"),
            "n_group": groups, "topk_group": int(self._key(a, "expert_group_used_count", 1) or 1),
            "moe_layer_freq": 1, "rope_interleave": True,
        })

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(self.metadata, source=self.path)

    # ------------------------------------------------------------------ tensors
    def iter_tensors(self, dtype: torch.dtype = torch.float32, *, device: torch.device | str | None = None,
                     keep_quantized: bool = False, _only: set | None = None
                     ) -> Iterator[tuple[str, torch.Tensor | GGUFBlockWeight]]:
        """Yield ``(HF name, tensor)`` dequantized to ``dtype``, one tensor at a time.

        With ``keep_quantized``, every matrix stored in a block type the GGUF kernels run
        (:data:`KEPT_QTYPES`; the token embedding excepted, it is gathered, not multiplied) is yielded
        as a :class:`GGUFBlockWeight` instead: its raw block rows (on ``device``), GGML type (per
        tensor: a Q4_K_M file mixes Q4_K and Q6_K) and ``(N, K)`` shape, after the same row
        reorders (llama q/k un-permute, bloom's per-head q/k/v, per-expert split) as the dense path.
        Everything else (norms, F32/F16/BF16 matrices, other block types) is dequantized as usual.

        Stacked MoE expert tensors ``blk.{i}.ffn_{gate,up,down}_exps`` ``[E, ...]`` are yielded per
        expert as ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (the names of HF
        checkpoints on disk). ``device``: decode there (e.g. ``"cuda"``: only the quantized
        bytes cross PCIe, and the GPU does the unpacking); default: the CPU.

        Tensors without an HF mapping keep their GGUF name (so a weight check reports them);
        ``rope_freqs.weight`` (llama3 rope factors, not an HF parameter) is skipped.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise GraphDSLError(f"iter_tensors: dtype must be a floating torch.dtype, got {dtype!r}")
        arch = self._check_arch()
        cfg = self.hf_config()
        kv_b_halves: dict[str, dict[str, torch.Tensor]] = {}   # deepseek2: layer -> {"attn_k_b"|"attn_v_b": tensor}
        for name, t in self._tensors.items():
            if name in _SKIPPED or (_only is not None and name not in _only):
                continue
            qname = t.tensor_type.name
            if qname not in _BLOCKS:
                raise GraphDSLError(f"{self.path!r}: tensor {name!r} has GGML type {qname}, "
                                    f"which graphdsl cannot dequantize; supported: "
                                    f"{list(SUPPORTED_QTYPES)}")
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            m = _LAYER_RE.match(name)
            keep = (keep_quantized and qname in KEPT_QTYPES and len(shape) >= 2
                    and name != "token_embd.weight" and not (m and m.group(2) in _NOT_KEPT))
            try:
                w = (_block_rows(t.data, qname, shape, device) if keep
                     else dequantize(t.data, t.tensor_type, shape, device=device))
            except GraphDSLError as e:
                raise GraphDSLError(f"{self.path!r}: tensor {name!r}: {e}") from None
            except Exception as e:  # an I/O error from the memory map of a damaged file
                raise GraphDSLError(f"{self.path!r}: cannot read tensor {name!r}: "
                                    f"{_first_line(e)}") from None
            if arch in _PERMUTED_QK and ".attn_q." in name:
                w = _unpermute_rows(w, cfg["num_attention_heads"])
            elif arch in _PERMUTED_QK and ".attn_k." in name:
                w = _unpermute_rows(w, cfg["num_key_value_heads"])
            if m and m.group(2) in ("attn_k_b", "attn_v_b"):
                halves = kv_b_halves.setdefault(m.group(1), {})
                halves[m.group(2)] = w
                if len(halves) == 2:
                    yield (f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight",
                           _join_kv_b(halves.pop("attn_k_b"), halves.pop("attn_v_b")).to(dtype))
                continue
            if m and m.group(2) == "exp_probs_b":
                yield f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias", w.to(dtype)
                continue
            if m and m.group(2) in _EXPERT_NAMES:
                for e in range(w.shape[0]):
                    yield (_expert_name(m.group(1), e, m.group(2)),
                           _blocks(qname, shape, w[e]) if keep else w[e].to(dtype).contiguous())
                continue
            if m and m.group(2) == "ffn_gate_inp_shexp" and w.dim() == 1:
                w = w.reshape(1, -1)
            if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
                w = w - 1.0
            if arch == "bloom" and ".attn_qkv." in name:
                w = _per_head_qkv(w, cfg["num_attention_heads"])
            yield hf_name(name, arch) or name, (_blocks(qname, shape, w) if keep else w.to(dtype))


    def iter_tensors_lazy(self, dtype: torch.dtype = torch.float32, *, device: torch.device | str | None = None,
                          stats=None) -> Iterator[tuple[str, Any]]:
        """Like :meth:`iter_tensors`, but 2-D weights that need no conversion beyond llama.cpp's q/k
        row permutation come as lazy handles (``shape``, ``read(index)``): a tensor-parallel rank's
        rows, or its columns on block boundaries, are dequantized from just their bytes. The other
        tensors (stacked experts, norms, joined halves, 1-D) come whole, after the lazy ones.
        ``stats`` (a :class:`~graphdsl.runtime.loaders.safetensors.ReadStats`) adds up the GGUF bytes read."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise GraphDSLError(f"iter_tensors_lazy: dtype must be a floating torch.dtype, got {dtype!r}")
        arch = self._check_arch()
        cfg = self.hf_config()
        whole: set = set()
        for name, t in self._tensors.items():
            if name in _SKIPPED:
                continue
            m = _LAYER_RE.match(name)
            special = m is not None and m.group(2) in (*_EXPERT_NAMES, "attn_k_b", "attn_v_b", "exp_probs_b",
                                                      "ffn_gate_inp_shexp")
            plain = (len(t.shape) == 2 and t.tensor_type.name in _BLOCKS and hf_name(name, arch) is not None
                     and not special and not (arch == "bloom" and ".attn_qkv." in name)
                     and not (arch in _NORM_PLUS_ONE and name.endswith("norm.weight")))
            if not plain:
                whole.add(name)
                if stats is not None:
                    stats.bytes += int(t.data.nbytes)
                    stats.tensors += 1
                continue
            heads = None
            if arch in _PERMUTED_QK and ".attn_q." in name:
                heads = cfg["num_attention_heads"]
            elif arch in _PERMUTED_QK and ".attn_k." in name:
                heads = cfg["num_key_value_heads"]
            yield hf_name(name, arch), _GGUFTensor(self.path, name, t, heads, dtype, device, stats)
        if whole:
            yield from self.iter_tensors(dtype, device=device, _only=whole)


class _GGUFTensor:
    """A 2-D GGUF weight not read yet; :meth:`read` dequantizes only the rows (and, on block
    boundaries, the columns) asked for. ``heads``: undo llama.cpp's q/k row permutation over this
    many heads (a row range then widens to whole heads)."""

    def __init__(self, path: str, name: str, t, heads: int | None, dtype, device, stats):
        self.path, self.name, self._t, self._heads = path, name, t, heads
        self._dtype, self._device, self._stats = dtype, device, stats
        self.shape = tuple(int(s) for s in reversed(t.shape.tolist()))

    def read(self, index: tuple = ()) -> torch.Tensor:
        rows, cols = self.shape
        rsl = index[0] if len(index) > 0 else slice(None)
        csl = index[1] if len(index) > 1 else slice(None)
        if not (isinstance(rsl, slice) and isinstance(csl, slice)) or len(index) > 2:
            raise GraphDSLError(f"GGUF tensor {self.name!r}: read takes up to two slices, got {index!r}")
        r0, r1, rstep = rsl.indices(rows)
        c0, c1, cstep = csl.indices(cols)
        per_block, nbytes = _BLOCKS[self._t.tensor_type.name]
        a0, a1 = r0, r1                       # the rows decoded: whole heads when un-permuting
        if self._heads is not None:
            per = rows // self._heads
            a0, a1 = r0 // per * per, -(-r1 // per) * per
        b0, b1 = (c0, c1) if c0 % per_block == 0 and c1 % per_block == 0 and cstep == 1 else (0, cols)
        data = self._t.data
        try:
            if data.dtype == np.uint8:        # quantized: [rows, bytes per row] of whole blocks
                part = data[a0:a1, b0 // per_block * nbytes:b1 // per_block * nbytes]
            else:                             # F32 / F16 / BF16: typed [rows, cols]
                part = data[a0:a1, b0:b1]
            part = np.ascontiguousarray(part)
            w = dequantize(part, self._t.tensor_type, (a1 - a0, b1 - b0), device=self._device)
        except GraphDSLError as e:
            raise GraphDSLError(f"{self.path!r}: tensor {self.name!r}: {e}") from None
        except Exception as e:
            raise GraphDSLError(f"{self.path!r}: cannot read tensor {self.name!r}: {_first_line(e)}") from None
        if self._stats is not None:
            self._stats.bytes += int(part.nbytes)
            self._stats.tensors += 1
        if self._heads is not None:
            w = _unpermute_rows(w, (a1 - a0) // (rows // self._heads))
        w = w[r0 - a0:r1 - a0:rstep, c0 - b0:c1 - b0:cstep]
        return w.to(self._dtype)


def _block_rows(data, qname: str, shape: tuple[int, ...], device) -> torch.Tensor:
    """The raw bytes of a block-quantized tensor of logical ``shape`` as uint8 rows
    ``[*shape[:-1], row_bytes]`` on ``device`` (checked against the type's row size)."""
    with warnings.catch_warnings():  # a read-only memory map: we only ever read it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    rb = row_bytes(qname, shape[-1])
    if raw.numel() != int(np.prod(shape[:-1])) * rb:
        raise GraphDSLError(f"{qname} tensor of shape {list(shape)} needs {int(np.prod(shape[:-1])) * rb} bytes, "
                            f"got {raw.numel()}")
    raw = raw.reshape(*shape[:-1], rb)
    return raw.to(device) if device is not None else raw


def _blocks(qname: str, shape: tuple[int, ...], rows: torch.Tensor) -> GGUFBlockWeight:
    return GGUFBlockWeight(qname, (rows.shape[0], shape[-1]), rows.contiguous())


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's ``kv_b_proj [heads * (nope + v), kv_lora_rank]`` from llama.cpp's halves:
    ``attn_k_b [heads, kv_lora_rank, nope]`` (transposed per head) and ``attn_v_b [heads, v, kv_lora_rank]``."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise GraphDSLError(f"attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} do not fit "
                            "[heads, kv_lora_rank, nope] and [heads, v_head_dim, kv_lora_rank]")
    joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return joined.reshape(-1, k_b.shape[1]).contiguous()


def _plain(v: Any) -> Any:
    """Reader values → plain Python (numpy scalars to int/float/bool, arrays to lists)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
