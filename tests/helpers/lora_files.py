"""Random PEFT-format LoRA adapters for a loaded model, written without ``peft`` (GPU tests and
benchmarks use them at real shapes; CPU tests make theirs with ``peft`` itself)."""
from __future__ import annotations

import json
import os

import torch

__all__ = ["write_random_adapter"]


def write_random_adapter(llm, directory, *, rank: int = 16, alpha: float | None = None, seed: int = 0,
                         modules: tuple[str, ...] | None = None, std: float = 0.05) -> str:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` for every linear LoRA can adapt
    in ``llm`` (or only the checkpoint modules whose last name is in ``modules``), factors
    ~ N(0, ``std``); returns the directory. ``llm`` must have LoRA enabled."""
    from safetensors.torch import save_file
    lora = llm.model.lora
    gen = torch.Generator().manual_seed(seed)
    tensors, names = {}, set()
    for module, part in sorted(lora._parts.items()):
        leaf = module.rsplit(".", 1)[-1]
        if modules is not None and leaf not in modules:
            continue
        names.add(leaf)
        t = lora.targets[part.path]
        rows = part.rows.stop - part.rows.start
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, t.in_features, generator=gen) * std
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * std
    os.makedirs(directory, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
           "target_modules": sorted(names), "lora_dropout": 0.0, "use_rslora": False, "bias": "none"}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"))
    return str(directory)
