"""Tiny pre-quantized HF checkpoints for the loader tests, written in each format's on-disk layout.

Each writer takes a tiny random transformers model, quantizes its decoder linears with a small
round-to-nearest reference quantizer, writes ``model.safetensors`` plus ``config.json`` with the
format's ``quantization_config``, and returns the same transformers model with every quantized
linear's weight replaced by its dequantized value — the reference the loaded engine must match.

* compressed-tensors: the ``compressed-tensors`` package's own compressors write the tensors and
  its own ``decompress`` gives the dequantized weights (scales and zero points computed here).
* AutoAWQ (GEMM) and GPTQ (v1 / v2): packed by hand below, following those projects' layouts
  (AWQ's interleaved nibble order ``[0, 2, 4, 6, 1, 3, 5, 7]``, GPTQ's sequential order along the
  inputs and v1's ``stored zero = zero - 1``); dequantized from the unpacked codes.
"""
from __future__ import annotations

import copy
import json
import os
import re

import torch

from graphdsl.quant import pack_int4, unpack_int4
from tests.models.hf_tiny import make_checkpoint

__all__ = ["LINEARS", "base_model", "write_compressed_tensors", "write_awq", "write_gptq", "mixtral_names"]

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# more linears compressed-tensors quantizes where a family has them: MLA's projections, DeepSeek's shared experts
MORE_LINEARS = ("self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "mlp.shared_experts.gate_proj",
                "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
# hidden 128, intermediate 256: every linear's input count takes groups of 32, 64 and 128
GEOMETRY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def base_model(family: str, directory) -> "torch.nn.Module":
    """A tiny random ``family`` model saved (full precision) to ``directory``."""
    return make_checkpoint(family, directory, **GEOMETRY)


def _linears(model):
    mods = dict(model.named_modules())
    return [(f"model.layers.{i}.{leaf}", mods[f"model.layers.{i}.{leaf}"])
            for i in range(model.config.num_hidden_layers) for leaf in LINEARS]


def _pieces(model, ref):
    """``(checkpoint module name, weight [n, k], put, stored name)`` of every linear
    :func:`write_compressed_tensors` quantizes: the attention and MLP projections of each layer and,
    in an MoE layer, each expert's gate, up and down (transformers 5 holds them as one
    ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``, and saves them per
    expert, as these names). ``put(w)`` writes the dequantized weight into ``ref``; ``stored`` is
    the state-dict entry the piece's quantized tensors replace."""
    mods, refmods = dict(model.named_modules()), dict(ref.named_modules())
    out = []
    for i in range(model.config.num_hidden_layers):
        for leaf in LINEARS + MORE_LINEARS:
            name = f"model.layers.{i}.{leaf}"
            if name in mods:
                out.append((name, mods[name].weight.detach().float(), refmods[name].weight.copy_, f"{name}.weight"))
        experts = f"model.layers.{i}.mlp.experts"
        if experts not in mods or not hasattr(mods[experts], "gate_up_proj"):
            continue
        up, down = mods[experts].gate_up_proj.detach().float(), mods[experts].down_proj.detach().float()
        r_up, r_down = refmods[experts].gate_up_proj, refmods[experts].down_proj
        inter = up.shape[1] // 2
        for e in range(up.shape[0]):
            out += [(f"{experts}.{e}.gate_proj", up[e, :inter], r_up[e, :inter].copy_, f"{experts}.gate_up_proj"),
                    (f"{experts}.{e}.up_proj", up[e, inter:], r_up[e, inter:].copy_, f"{experts}.gate_up_proj"),
                    (f"{experts}.{e}.down_proj", down[e], r_down[e].copy_, f"{experts}.down_proj")]
    return out


def _save(model, directory, tensors: dict, quantization_config: dict, skip: set, rename=None) -> None:
    """Write ``tensors`` (the quantized linears' stored tensors) and every other tensor of ``model``
    (every name through ``rename``, when given), and ``config.json`` with ``quantization_config``."""
    from safetensors.torch import save_file
    out = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k not in skip}
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    out.update({k: v.contiguous() for k, v in tensors.items()})
    if rename is not None:
        out = {rename(k): v for k, v in out.items()}
    os.makedirs(directory, exist_ok=True)
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


# -- compressed-tensors ------------------------------------------------------------------------------
def mixtral_names(name: str) -> str:
    """transformers 5's Mixtral names as Mixtral checkpoints store them (``block_sparse_moe``, the
    experts' ``w1``/``w3``/``w2``), for a ``rename`` of :func:`write_compressed_tensors`."""
    name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        name = re.sub(rf"\.mlp\.experts\.(\d+)\.{ours}\.", rf".block_sparse_moe.experts.\1.{theirs}.", name)
    return name


def write_compressed_tensors(model, directory, *, fmt: str, weights: dict, input_activations: dict | None = None,
                             ignore=("lm_head",), skip_modules=(), act_order: bool = False, rename=None):
    """Quantize ``model``'s decoder linears with compressed-tensors' compressor for ``fmt``
    (``pack-quantized`` / ``naive-quantized`` / ``int-quantized`` / ``float-quantized``) and
    ``weights`` (its QuantizationArgs fields); return the dequantized reference model. ``rename``
    maps every written tensor name (a family's on-disk names: :func:`mixtral_names`).
    ``act_order`` writes the older ``actorder: group`` layout (int4 groups; the library no longer
    writes it): each group takes the inputs a random ``weight_g_idx`` assigns it (one order per
    input, as for :func:`write_gptq`), compressed in group order and stored back in input order."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    args = QuantizationArgs(**weights)
    acts = None if input_activations is None else QuantizationArgs(**input_activations)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    comp = BaseCompressor.load_from_registry(fmt)
    ref = copy.deepcopy(model)
    tensors, skip, orders = {}, set(), {}
    gen = torch.Generator().manual_seed(0)
    for name, w, put, stored_as in _pieces(model, ref):
        if name.rsplit(".", 1)[-1] in skip_modules:
            continue
        n, k = w.shape
        g_idx, order = (_group_order(orders, name, k, args.group_size, gen, "shared") if act_order
                        else (None, torch.arange(k)))
        wo = w[:, order]
        stored = comp.compress({"weight": wo.clone(), **_ct_qparams(wo, args)}, scheme)
        deq = torch.empty(n, k)
        deq[:, order] = comp.decompress(dict(stored), scheme)["weight"].float()
        if act_order:                                   # the codes back in input order, and the order
            if fmt == "pack-quantized":
                codes = torch.empty(n, k, dtype=torch.uint8)
                codes[:, order] = unpack_int4(stored["weight_packed"].contiguous().view(torch.uint8))
                stored["weight_packed"] = pack_int4(codes).view(torch.int32)
            else:
                q = torch.empty_like(stored["weight"])
                q[:, order] = stored["weight"]
                stored["weight"] = q
            stored["weight_g_idx"] = g_idx.clone()
        tensors.update({f"{name}.{k}": v for k, v in stored.items()})
        skip.add(stored_as)
        with torch.no_grad():
            put(deq)
    group = {"targets": ["Linear"], "weights": {**args.model_dump(mode="json"), **({"actorder": "group"} if act_order
                                                                                   else {})},
             "input_activations": None if acts is None else acts.model_dump(mode="json"), "format": fmt}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
          "ignore": list(ignore), "quantization_status": "compressed"}
    _save(model, directory, tensors, qc, skip, rename)
    return ref


def _ct_qparams(w: torch.Tensor, args) -> dict:
    """Round-to-nearest ``weight_scale`` (and ``weight_zero_point``) for ``w [n, k]`` under ``args``."""
    n, k = w.shape
    if args.type == "float":
        amax = w.abs().amax() if args.strategy == "tensor" else w.abs().amax(1, keepdim=True)
        return {"weight_scale": (amax / 448.0).reshape(1) if args.strategy == "tensor" else amax / 448.0}
    g = args.group_size if args.strategy == "group" else k
    wg = w.reshape(n, k // g, g)
    qmax = 2 ** (args.num_bits - 1) - 1
    if args.symmetric:
        s = wg.abs().amax(-1) / (qmax + 0.5)
        return {"weight_scale": s}
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    s = (hi - lo) / (2 * qmax + 1)
    zp = torch.round(-qmax - 1 - lo / s).clamp(-qmax - 1, qmax).to(torch.int8)
    return {"weight_scale": s, "weight_zero_point": zp}


# -- AWQ / GPTQ: hand-packed ------------------------------------------------------------------------
def _rtn_int4(w: torch.Tensor, group: int, sym: bool):
    """Round-to-nearest int4 of ``w [n, k]`` per group of ``group`` inputs: codes ``q [n, k]``
    (0..15), zeros ``z [n, k/g]`` (8 when ``sym``) and fp16 scales ``s [n, k/g]``, with
    ``W ≈ (q - z) * s``."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    if sym:
        s = (wg.abs().amax(-1) / 7.5).half()
        z = torch.full_like(s, 8, dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).long()
    q = (torch.round(wg / s.float()[..., None]) + z[..., None]).clamp(0, 15).long().reshape(n, k)
    return q, z, s


def _dequantize(q, z, s, group):
    n, k = q.shape
    return ((q.reshape(n, k // group, group) - z[..., None]).float() * s.float()[..., None]).reshape(n, k)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """``[..., 8]`` values 0..15 -> int32 words, value ``i`` at bits ``4i``."""
    acc = torch.zeros(nibbles.shape[:-1], dtype=torch.int64)
    for i in range(8):
        acc |= nibbles[..., i].long() << (4 * i)
    return torch.where(acc >= 2 ** 31, acc - 2 ** 32, acc).to(torch.int32)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ's GEMM pack: nibble i holds column AWQ_ORDER[i] of each 8


def _awq_pack(cols: torch.Tensor) -> torch.Tensor:
    """``[r, c]`` codes -> AWQ int32 ``[r, c/8]``."""
    r, c = cols.shape
    return _words(cols.reshape(r, c // 8, 8)[..., list(AWQ_ORDER)])


def write_awq(model, directory, *, group: int, modules_to_not_convert=None):
    """AutoAWQ GEMM checkpoint (asymmetric int4, ``group`` inputs per group); returns the reference."""
    ref = copy.deepcopy(model)
    refmods = dict(ref.named_modules())
    tensors, skip = {}, set()
    for name, m in _linears(model):
        if modules_to_not_convert and any(x in name for x in modules_to_not_convert):
            continue
        q, z, s = _rtn_int4(m.weight.detach().float(), group, sym=False)
        tensors[f"{name}.qweight"] = _awq_pack(q.T.contiguous())          # [k, n/8]
        tensors[f"{name}.qzeros"] = _awq_pack(z.T.contiguous())           # [k/g, n/8]
        tensors[f"{name}.scales"] = s.T.contiguous()                       # [k/g, n] fp16
        skip.add(f"{name}.weight")
        with torch.no_grad():
            refmods[name].weight.copy_(_dequantize(q, z, s, group))
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if modules_to_not_convert:
        qc["modules_to_not_convert"] = list(modules_to_not_convert)
    _save(model, directory, tensors, qc, skip)
    return ref


_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _group_order(orders: dict, name: str, k: int, group: int, gen, act_order: str | None):
    """``(g_idx, order)`` of linear ``name``: the group of each of its ``k`` inputs (``k // group``,
    or with ``act_order`` a random permutation of it: ``"shared"`` one per input, kept in ``orders``
    for q/k/v and for gate/up as GPTQ's Hessian order is; ``"own"`` one per linear) and the inputs in
    group order (group 0's inputs, then group 1's, ...)."""
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order is not None:
        parent, _, leaf = name.rpartition(".")
        key = (parent, _SHARED_INPUT.get(leaf, leaf) if act_order == "shared" else leaf)
        g_idx = orders.setdefault(key, g_idx[torch.randperm(k, generator=gen)])
    return g_idx, torch.argsort(g_idx.long(), stable=True)


def write_gptq(model, directory, *, group: int, sym: bool, v2: bool = False, act_order=False,
               bits: int = 4):
    """GPTQ checkpoint (``group`` -1: per channel); v1 stores ``zero - 1``, v2 the zero itself.
    ``act_order`` (desc_act): each group takes the inputs a random ``g_idx`` assigns it (one order
    per input, shared by q/k/v and by gate/up as GPTQ's Hessian order is; ``"mismatched"``: one per
    linear); ``"shuffled"`` writes a random ``g_idx`` the codes do not follow (a broken file);
    ``bits`` other than 4 only changes the config (to test the refusal)."""
    ref = copy.deepcopy(model)
    refmods = dict(ref.named_modules())
    tensors, skip, orders = {}, set(), {}
    gen = torch.Generator().manual_seed(0)
    for name, m in _linears(model):
        w = m.weight.detach().float()
        n, k = w.shape
        g = k if group == -1 else group
        g_idx, order = _group_order(orders, name, k, g, gen, {True: "shared", "mismatched": "own"}.get(act_order))
        q_o, z, s = _rtn_int4(w[:, order], g, sym)
        q = torch.empty_like(q_o)
        q[:, order] = q_o
        tensors[f"{name}.qweight"] = _words(q.T.reshape(k // 8, 8, n).permute(0, 2, 1))   # [k/8, n]
        tensors[f"{name}.qzeros"] = _words((z.T - (0 if v2 else 1)).reshape(k // g, n // 8, 8))  # [k/g, n/8]
        tensors[f"{name}.scales"] = s.T.contiguous()
        tensors[f"{name}.g_idx"] = (g_idx[torch.randperm(k, generator=gen)] if act_order == "shuffled" else g_idx).clone()
        skip.add(f"{name}.weight")
        with torch.no_grad():
            deq = torch.empty(n, k)
            deq[:, order] = _dequantize(q_o, z, s, g)
            refmods[name].weight.copy_(deq)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": bool(act_order),
          "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    _save(model, directory, tensors, qc, skip)
    return ref
