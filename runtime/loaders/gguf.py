"""GGUF checkpoints: metadata → HF config, tensors → HF parameter names, block dequantization.

Reading goes through the ``gguf`` package's ``GGUFReader`` (memory-mapped); everything after the
raw bytes is ours, written in torch so the same code decodes on the CPU or on a GPU:

- :func:`dequantize` turns the raw block bytes of one tensor into float32 (formats below);
- :class:`GGUFCheckpoint` renames llama.cpp tensors to HF names (splitting stacked MoE experts
  into per-expert tensors), undoes the q/k row permutation
  llama.cpp's converter applies to llama-architecture attention weights (and the ``+ 1`` it adds
  to Gemma's norm weights, and its ``[q | k | v]`` order of Bloom's fused projection), builds a HF
  ``config.json``-style dict from the ``{arch}.*`` metadata, and a :class:`Tokenizer` from
  ``tokenizer.*``.

Block formats (little endian; ``d``, ``m``, ``dmin`` are float16; ``y`` is the output):

- ``Q8_0`` (32 values, 34 B): ``d, q[32] int8`` → ``y = d·q``.
- ``Q4_0`` (32, 18 B): ``d, qs[16]``; value ``j < 16`` is the low nibble of ``qs[j]``, value
  ``j + 16`` the high nibble → ``y = d·(nibble − 8)``.
- ``Q4_1`` (32, 20 B): ``d, m, qs[16]`` → ``y = d·nibble + m``.
- ``Q5_0`` (32, 22 B): ``d, qh u32, qs[16]``; bit ``j`` of ``qh`` is the fifth bit of value ``j``
  → ``y = d·(q − 16)``.  ``Q5_1`` (32, 24 B): ``d, m, qh, qs`` → ``y = d·q + m``.
- ``Q4_K`` (256, 144 B): ``d, dmin, scales[12], qs[128]``: eight sub-blocks of 32 with 6-bit
  scale ``sc`` and min ``mn`` packed in ``scales``; chunk ``c`` (64 values) reads ``qs[32c:32c+32]``,
  low nibbles for sub-block ``2c``, high nibbles for ``2c+1`` → ``y = d·sc·q − dmin·mn``.
- ``Q5_K`` (256, 176 B): ``d, dmin, scales[12], qh[32], qs[128]``; as Q4_K plus a fifth bit from
  ``qh[l]`` bit ``2c`` (low half of chunk ``c``) or ``2c+1`` (high half).
- ``Q2_K`` (256, 84 B): ``scales[16], qs[64], d, dmin``; sixteen sub-blocks of 16, each with
  a 4-bit scale (low nibble) and 4-bit min (high nibble); sub-block ``8h + 2j + s`` takes bits
  ``2j..2j+1`` of ``qs[32h + 16s + l]`` → ``y = d·sc·q − dmin·mn``.
- ``Q3_K`` (256, 110 B): ``hmask[32], qs[64], scales[12], d``; 2-bit values as in Q2_K, minus 4
  unless bit ``4h + j`` of ``hmask[16s + l]`` is set; sixteen signed 6-bit scales (``−32``)
  → ``y = d·sc·q``.
- ``Q6_K`` (256, 210 B): ``ql[128], qh[64], scales[16] int8, d``; two halves of 128; in half ``h``
  value ``l + 32k`` (``k`` = 0..3) takes 4 bits from ``ql`` (low nibble of ``ql[l]``/``ql[l+32]``
  for k = 0/1, high for k = 2/3) and 2 bits ``(qh[l] >> 2k) & 3``, minus 32, times
  ``d·scales[8h + l//16 + 2k]``.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from graphdsl.errors import GraphDSLError

from .tokenizer import Tokenizer

__all__ = ["GGUFCheckpoint", "dequantize", "SUPPORTED_QTYPES", "SUPPORTED_ARCHITECTURES"]


def _qtype_enum():
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType


# name -> (values per block, bytes per block)
_BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
SUPPORTED_QTYPES = tuple(_BLOCKS)


# The decoders below take ``b``: a uint8 torch tensor ``[n_blocks, bytes_per_block]`` (CPU or
# CUDA) and return float32 ``[n_blocks, values_per_block]``.

def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` bytes → ``[n, 1]`` float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes → ``[n, 32]``: low nibbles then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _deq_q8_0(b):
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _deq_q4_0(b):
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8.0)


def _deq_q4_1(b):
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _fifth_bits(qh_bytes: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` bytes of a little-endian u32 → ``[n, 32]`` bits (bit j for value j).
    (Read as int32: an arithmetic shift still leaves bit 31 in place for ``& 1``.)"""
    qh = qh_bytes.contiguous().view(torch.int32)                         # [n, 1]
    shifts = torch.arange(32, dtype=torch.int32, device=qh.device)
    return ((qh >> shifts) & 1).to(torch.uint8)


def _deq_q5_0(b):
    q = _nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.float() - 16.0)


def _deq_q5_1(b):
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ``[n, 12]`` Q4_K/Q5_K scale bytes → 6-bit scales and mins, each ``[n, 8]``:
    j < 4: ``s[j] & 63``, ``s[j+4] & 63``; j >= 4: low 4 bits from ``s[j+4]`` (low/high nibble),
    high 2 bits from the top of ``s[j-4]`` / ``s[j]``."""
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _k_apply(d, dmin, sc, mn, q):
    """``q [n, 8, 32]`` with per-sub-block scale/min → ``[n, 256]``."""
    y = (d * sc)[:, :, None] * q.float() - (dmin * mn)[:, :, None]
    return y.reshape(q.shape[0], 256)


def _k_low_high(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 128]`` bytes → ``[n, 8, 32]`` 4-bit values in sub-block order."""
    chunks = qs.reshape(-1, 4, 32)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, 8, 32)


def _deq_q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _k_apply(d, dmin, sc, mn, _k_low_high(b[:, 16:144]))


def _deq_q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]                                                     # [n, 32]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)         # sub-block j reads bit j
    high = (qh[:, None, :] >> shifts[None, :, None]) & 1                 # [n, 8, 32]
    q = _k_low_high(b[:, 48:176]) | (high << 4)
    return _k_apply(d, dmin, sc, mn, q)


def _deq_q6_k(b):
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(b[:, 208:210]).reshape(n, 1, 1, 1, 1)
    low = torch.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F,
                       ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], dim=2)             # [n, 2, 4, 32]
    high = torch.stack([(qh >> (2 * k)) & 3 for k in range(4)], dim=2)             # [n, 2, 4, 32]
    q = (low | (high << 4)).float() - 32.0
    # scale index within the half: 2k + l // 16, laid out over (k, l // 16)
    s = sc.reshape(n, 2, 4, 2, 1)
    y = d * s * q.reshape(n, 2, 4, 2, 16)
    return y.reshape(n, 256)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 64]`` Q2_K/Q3_K bytes → ``[n, 2, 4, 2, 16]`` 2-bit values indexed (half, shift j,
    sub, l): byte ``qs[32·half + 16·sub + l]``, bits ``2j..2j+1``; flattening gives value order."""
    q = qs.reshape(-1, 2, 1, 2, 16)
    shifts = (2 * torch.arange(4, dtype=torch.uint8, device=qs.device)).reshape(1, 1, 4, 1, 1)
    return (q >> shifts) & 3


def _deq_q2_k(b):
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = _crumbs(b[:, 16:80]).reshape(n, 16, 16).float()
    scale = d * (sc & 0x0F).float()
    mins = dmin * (sc >> 4).float()
    return (scale[:, :, None] * q - mins[:, :, None]).reshape(n, 256)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """``[n, 12]`` → ``[n, 16]`` signed 6-bit scales: low 4 bits from ``s[i]`` (i < 8) or
    ``s[i-8] >> 4``, high 2 bits ``(s[8 + i % 4] >> 2·(i // 4)) & 3``; minus 32."""
    low = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=1)
    hi_src = s[:, 8:12].repeat(1, 4)                                     # s[8 + i % 4]
    hi_shift = (2 * (torch.arange(16, device=s.device) // 4)).to(torch.uint8)
    high = (hi_src >> hi_shift) & 3
    return (low | (high << 4)).float() - 32.0


def _deq_q3_k(b):
    n = b.shape[0]
    hmask = b[:, 0:32].reshape(n, 1, 1, 2, 16)                           # hm[16·sub + l]
    bit = (4 * torch.arange(2, device=b.device).reshape(1, 2, 1, 1, 1)
           + torch.arange(4, device=b.device).reshape(1, 1, 4, 1, 1)).to(torch.uint8)
    high = (hmask >> bit) & 1                                            # [n, 2, 4, 2, 16]
    q = _crumbs(b[:, 32:96]).float() - 4.0 * (1 - high).float()
    scale = _f16(b[:, 108:110]) * _q3_k_scales(b[:, 96:108])             # [n, 16]
    return (scale[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


_DEQUANT = {"Q8_0": _deq_q8_0, "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1, "Q5_0": _deq_q5_0,
            "Q5_1": _deq_q5_1, "Q2_K": _deq_q2_k, "Q3_K": _deq_q3_k, "Q4_K": _deq_q4_k,
            "Q5_K": _deq_q5_k, "Q6_K": _deq_q6_k}


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
    if name == "F32":
        out = raw.view(torch.float32).clone()
    elif name == "F16":
        out = raw.view(torch.float16).float()
    elif name == "BF16":
        out = raw.view(torch.bfloat16).float()
    else:
        out = _DEQUANT[name](raw.reshape(-1, nbytes))
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
                     "bloom": {"attn_qkv": "self_attention.query_key_value"}}
# stacked experts [E, ...] -> one HF tensor per expert: mlp.experts.{e}.{proj}.weight
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
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
        gemma2, bloom; a llama with ``expert_count`` is Mixtral)."""
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
            cfg["rope_scaling"] = rs
        return cfg

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(self.metadata, source=self.path)

    # ------------------------------------------------------------------ tensors
    def iter_tensors(self, dtype: torch.dtype = torch.float32, *,
                     device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(HF name, tensor)`` dequantized to ``dtype``, one tensor at a time.

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
        for name, t in self._tensors.items():
            if name not in _SKIPPED:
                yield from self._converted(name, t, dtype, device, arch, cfg)

    def iter_tensors_lazy(self, dtype: torch.dtype = torch.float32, *, device: torch.device | str | None = None,
                          stats=None) -> Iterator[tuple[str, Any]]:
        """Like :meth:`iter_tensors`, but 2-D weights that need no conversion beyond llama.cpp's q/k
        row permutation come as lazy handles (``shape``, ``read(index)``): a tensor-parallel rank's
        rows, or its columns on block boundaries, are dequantized from just their bytes. Other
        tensors (stacked experts, norms, 1-D) come whole. ``stats`` (a
        :class:`~graphdsl.runtime.loaders.safetensors.ReadStats`) adds up the GGUF bytes read."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise GraphDSLError(f"iter_tensors_lazy: dtype must be a floating torch.dtype, got {dtype!r}")
        arch = self._check_arch()
        cfg = self.hf_config()
        for name, t in self._tensors.items():
            if name in _SKIPPED:
                continue
            m = _LAYER_RE.match(name)
            plain = (len(t.shape) == 2 and t.tensor_type.name in _BLOCKS and hf_name(name, arch) is not None
                     and not (m and m.group(2) in _EXPERT_NAMES) and not (arch == "bloom" and ".attn_qkv." in name)
                     and not (arch in _NORM_PLUS_ONE and name.endswith("norm.weight")))
            if not plain:
                if stats is not None:
                    stats.bytes += int(t.data.nbytes)
                    stats.tensors += 1
                yield from self._converted(name, t, dtype, device, arch, cfg)
                continue
            heads = None
            if arch in _PERMUTED_QK and ".attn_q." in name:
                heads = cfg["num_attention_heads"]
            elif arch in _PERMUTED_QK and ".attn_k." in name:
                heads = cfg["num_key_value_heads"]
            yield hf_name(name, arch), _GGUFTensor(self.path, name, t, heads, dtype, device, stats)

    def _converted(self, name: str, t, dtype, device, arch: str, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """One GGUF tensor dequantized and converted to HF names and layout (experts split)."""
        qname = t.tensor_type.name
        if qname not in _BLOCKS:
            raise GraphDSLError(f"{self.path!r}: tensor {name!r} has GGML type {qname}, "
                                f"which graphdsl cannot dequantize; supported: "
                                f"{list(SUPPORTED_QTYPES)}")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        try:
            w = dequantize(t.data, t.tensor_type, shape, device=device)
        except GraphDSLError as e:
            raise GraphDSLError(f"{self.path!r}: tensor {name!r}: {e}") from None
        except Exception as e:  # an I/O error from the memory map of a damaged file
            raise GraphDSLError(f"{self.path!r}: cannot read tensor {name!r}: "
                                f"{_first_line(e)}") from None
        if arch in _PERMUTED_QK and ".attn_q." in name:
            w = _unpermute_rows(w, cfg["num_attention_heads"])
        elif arch in _PERMUTED_QK and ".attn_k." in name:
            w = _unpermute_rows(w, cfg["num_key_value_heads"])
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _EXPERT_NAMES:
            proj = _EXPERT_NAMES[m.group(2)]
            for e in range(w.shape[0]):
                yield (f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight",
                       w[e].to(dtype).contiguous())
            return
        if m and m.group(2) == "ffn_gate_inp_shexp" and w.dim() == 1:
            w = w.reshape(1, -1)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1.0
        if arch == "bloom" and ".attn_qkv." in name:
            w = _per_head_qkv(w, cfg["num_attention_heads"])
        yield hf_name(name, arch) or name, w.to(dtype)


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
