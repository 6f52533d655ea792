"""Reading PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

Contract: :func:`load_peft_adapter` returns a :class:`PeftAdapter` whose ``weights`` map each
adapted checkpoint module (``model.layers.0.self_attn.q_proj``, the ``base_model.model.`` prefix
removed) to ``(A [r, in], B [out, r])`` and whose ``scaling`` is ``alpha / r`` (``alpha / sqrt(r)``
with ``use_rslora``). A LoRA linear computes ``y = x·Wᵀ + scaling · (x·Aᵀ)·Bᵀ``; dropout is a
training-time op and is ignored. Missing files, malformed configs, a tensor whose rank differs from
the config's ``r`` (or ``rank_pattern``) and a module with only one of A/B raise
:class:`LoRAError` naming the adapter, the module and the expected and actual values.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import torch

from graphdsl.errors import GraphDSLError

from .jsonfile import read_json_object

__all__ = ["LoRAError", "PeftAdapter", "load_peft_adapter"]

_CONFIG = "adapter_config.json"
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIXES = ("base_model.model.",)
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<name>[^.]+))?\.weight$")


class LoRAError(GraphDSLError):
    """A LoRA adapter that cannot be loaded or applied (files, config, ranks, target modules)."""


@dataclass
class PeftAdapter:
    """One adapter: per checkpoint module ``(A [r, in], B [out, r])``, and its scaling.

    ``scalings`` holds per-module scalings when ``rank_pattern``/``alpha_pattern`` give a module its
    own rank or alpha; :meth:`scaling_of` answers for any module."""

    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    scalings: dict[str, float] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max((a.shape[0] for a, _ in self.weights.values()), default=self.rank)

    def scaling_of(self, module: str) -> float:
        return self.scalings[module]


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's ``rank_pattern``/``alpha_pattern``: the value of the first key that the module name
    ends with (as a dotted suffix) or matches as a regex."""
    for key, value in (pattern or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, _CONFIG)
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"LoRA adapter {path!r}: missing {_CONFIG} (expected a PEFT adapter directory holding "
                        f"{_CONFIG} and {_WEIGHTS[0]})")
    cfg = read_json_object(cfg_path)
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {path!r}: peft_type must be 'LORA', got {peft_type!r}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise LoRAError(f"LoRA adapter {path!r}: adapter_config.json 'r' must be a positive int, got {r!r}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"LoRA adapter {path!r}: 'lora_alpha' must be a number, got {alpha!r}")
    if cfg.get("use_dora"):
        raise LoRAError(f"LoRA adapter {path!r}: use_dora=True adapters are not supported (expected plain LoRA)")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, _WEIGHTS[0])
    if os.path.isfile(st):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(st)
        except (SafetensorError, OSError) as e:
            raise LoRAError(f"LoRA adapter {path!r}: cannot read {_WEIGHTS[0]}: {e}") from None
    pt = os.path.join(path, _WEIGHTS[1])
    if os.path.isfile(pt):
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise LoRAError(f"LoRA adapter {path!r}: cannot read {_WEIGHTS[1]}: {e}") from None
    raise LoRAError(f"LoRA adapter {path!r}: missing weights (expected {_WEIGHTS[0]} or {_WEIGHTS[1]})")


def load_peft_adapter(path: str | os.PathLike) -> PeftAdapter:
    """Read the PEFT LoRA adapter directory ``path`` (see the module contract)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory (expected a PEFT adapter directory)")
    cfg = _read_config(path)
    r, alpha, rslora = cfg["r"], float(cfg.get("lora_alpha", cfg["r"])), bool(cfg.get("use_rslora", False))
    targets = cfg.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        m = _KEY.match(key)
        if m is None:
            if ".lora_embedding_" in key or ".lora_magnitude" in key:
                raise LoRAError(f"LoRA adapter {path!r}: tensor {key!r} is not supported (only linear LoRA A/B)")
            continue       # modules_to_save and other extras are not LoRA factors
        module = m.group("module")
        for p in _PREFIXES:
            if module.startswith(p):
                module = module[len(p):]
        parts.setdefault(module, {})[m.group("which")] = tensor
    adapter = PeftAdapter(path, r, alpha, rslora, targets)
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            have = "lora_A" if "A" in ab else "lora_B"
            raise LoRAError(f"LoRA adapter {path!r}: module {module!r} has {have} only (expected lora_A and lora_B)")
        a, b = ab["A"], ab["B"]
        rank = _pattern_value(cfg.get("rank_pattern"), module, r)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"LoRA adapter {path!r}: rank mismatch in {module!r}: config r={rank}, but lora_A is "
                            f"{list(a.shape)} and lora_B is {list(b.shape)} (expected [{rank}, in] and [out, {rank}])")
        mod_alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha))
        adapter.weights[module] = (a, b)
        adapter.scalings[module] = _scaling(mod_alpha, rank, rslora)
    if not adapter.weights:
        raise LoRAError(f"LoRA adapter {path!r}: no lora_A/lora_B tensors found")
    return adapter
