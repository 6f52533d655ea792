"""LoRA adapters on a :class:`FlashCausalLM`: targets, packing, and the GPU slot pool.

:class:`LoRAManager` owns, per adapted linear (every column/row-parallel linear of the decoder
layers), two slot buffers bound to the ``lora`` feature engines (see :mod:`graphdsl.layers.lora`):
``A [max_loras, parts·max_rank, in]`` and ``B [out, max_loras, parts·max_rank]``. An adapter read by
:func:`~graphdsl.runtime.loaders.peft.load_peft_adapter` is packed once on the host into that layout
(q/k/v or gate/up factors stacked, B block-diagonal with ``scaling`` folded in, ranks below
``max_rank`` zero-padded) and kept there; :meth:`LoRAManager.slots_for` copies the adapters a step
needs into free slots, evicting the least recently used resident ones (their host copies stay), so
at most ``max_loras`` adapters sit on the GPU while any number are registered. Loading into a
slot is an in-place copy: engines and CUDA graphs keep their bindings (hot swap without a rebuild).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import torch

from graphdsl.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from graphdsl.layers.lora import LoRATarget, lora_weight_names
from graphdsl.runtime.loaders.peft import LoRAError, PeftAdapter, load_peft_adapter

__all__ = ["LoRAManager", "LoRARequest", "lora_targets"]


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's shape): ``name`` (the key adapters are registered
    and served under), a positive ``id``, and the PEFT adapter directory ``path`` (loaded on first use)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"LoRARequest: lora_name must be a non-empty str, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise LoRAError(f"LoRARequest: lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise LoRAError(f"LoRARequest: lora_path must be a path, got {self.lora_path!r}")


def lora_targets(model) -> dict[str, LoRATarget]:
    """``{module path: geometry}`` of the linears LoRA may adapt: the parallel linears of the model
    body (not the lm_head, not replicated routers)."""
    model._assign_paths()
    out = {}
    for path, m in model.named_modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)) or isinstance(m, ReplicatedLinear):
            continue
        if path == "lm_head" or not path:
            continue
        parts = tuple(m.output_sizes) if getattr(m, "sources", ()) else (m.out_features,)
        out[path] = LoRATarget(m.in_features, m.out_features, parts)
    return out


@dataclass(frozen=True)
class _Part:
    path: str          # our module
    part: int          # which of its fused parts
    rows: slice        # its output rows


def _part_table(model, targets: dict[str, LoRATarget]) -> dict[str, _Part]:
    """Checkpoint module name (``model.layers.0.self_attn.q_proj``) → the part of our linear it is."""
    table = {}
    for key, slot in model.checkpoint_table().items():
        if not key.endswith(".weight") or not slot.param.endswith(".weight"):
            continue
        path = slot.param[:-len(".weight")]
        target = targets.get(path)
        if target is None or slot.reorder is not None:
            continue
        if slot.index == ():
            table[key[:-len(".weight")]] = _Part(path, 0, slice(0, target.out_features))
            continue
        rows = slot.index[0]
        starts = [sum(target.parts[:i]) for i in range(len(target.parts))]
        table[key[:-len(".weight")]] = _Part(path, starts.index(rows.start), rows)
    return table


class LoRAManager:
    """Registered adapters (host copies) and the bounded pool of GPU slots (see the module docstring).

    Args:
        model: the bound model (its weights give the device and dtype).
        max_loras: GPU slots: the most distinct adapters one step may use.
        max_lora_rank: the largest adapter rank accepted (slot width per fused part).
    """

    def __init__(self, model, *, max_loras: int = 4, max_lora_rank: int = 16):
        for k, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LoRAError(f"enable_lora: {k} must be a positive int, got {v!r}")
        weight = next(iter(model._bound.values()), None) if model._bound else None
        if weight is None:
            raise LoRAError("enable_lora: bind the model's weights first (the slots live on their device)")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_lora_rank
        self.device, self.dtype = weight.device, model.dtype
        self.targets = lora_targets(model)
        self._parts = _part_table(model, self.targets)
        self.buffers: dict[str, torch.Tensor] = {}
        for path, t in self.targets.items():
            a, b = lora_weight_names(path)
            width = max_lora_rank * len(t.parts)
            self.buffers[a] = torch.zeros(max_loras, width, t.in_features, dtype=self.dtype, device=self.device)
            self.buffers[b] = torch.zeros(t.out_features, max_loras, width, dtype=self.dtype, device=self.device)
        self._host: dict[str, dict[str, torch.Tensor]] = {}        # name -> packed buffers' rows
        self._resident: OrderedDict[str, int] = OrderedDict()     # name -> slot, least recently used first

    # -- registry ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._host)

    def add(self, name: str, path: str | os.PathLike) -> None:
        """Read, check and pack the PEFT adapter at ``path`` under ``name``; a resident adapter of the
        same name is replaced in its slot at once (hot swap)."""
        if not isinstance(name, str) or not name:
            raise LoRAError(f"load_lora: name must be a non-empty str, got {name!r}")
        self._host[name] = self._pack(load_peft_adapter(path))
        slot = self._resident.get(name)
        if slot is not None:
            self._copy_in(name, slot)

    def remove(self, name: str) -> None:
        if name not in self._host:
            raise LoRAError(f"remove_lora: no adapter named {name!r}; loaded: {self.names}")
        del self._host[name]
        self._resident.pop(name, None)

    def _pack(self, adapter: PeftAdapter) -> dict[str, torch.Tensor]:
        if adapter.max_rank > self.max_rank:
            raise LoRAError(f"LoRA adapter {adapter.path!r}: rank {adapter.max_rank} exceeds max_lora_rank="
                            f"{self.max_rank} (raise max_lora_rank in enable_lora / LLM(max_lora_rank=...))")
        packed: dict[str, torch.Tensor] = {}
        r0 = self.max_rank
        for module, (a, b) in adapter.weights.items():
            part = self._parts.get(self.model.checkpoint_name(module + ".weight")[:-len(".weight")])
            if part is None:
                known = sorted({m.rsplit(".", 1)[-1] for m in self._parts})
                raise LoRAError(f"LoRA adapter {adapter.path!r}: unknown target module {module!r} (this model adapts "
                                f"the linears {known} of its layers)")
            t = self.targets[part.path]
            rows = part.rows.stop - part.rows.start
            if a.shape[1] != t.in_features or b.shape[0] != rows:
                raise LoRAError(f"LoRA adapter {adapter.path!r}: {module!r} has lora_A {list(a.shape)} and lora_B "
                                f"{list(b.shape)}, expected [r, {t.in_features}] and [{rows}, r]")
            a_name, b_name = lora_weight_names(part.path)
            width = r0 * len(t.parts)
            if a_name not in packed:
                packed[a_name] = torch.zeros(width, t.in_features, dtype=self.dtype)
                packed[b_name] = torch.zeros(t.out_features, width, dtype=self.dtype)
            r, c = a.shape[0], part.part * r0
            packed[a_name][c:c + r] = a.to(self.dtype)
            packed[b_name][part.rows, c:c + r] = (b.float() * adapter.scaling_of(module)).to(self.dtype)
        for path in {part.path for part in self._parts.values()}:    # orders folded at bind (act-order)
            a_name, b_name = lora_weight_names(path)
            m = self.model.get_submodule(path) if a_name in packed else None
            if getattr(m, "input_order", None) is not None:
                packed[a_name] = packed[a_name][:, m.input_order]
            if getattr(m, "row_order", None) is not None:
                packed[b_name] = packed[b_name][m.row_order]
        if self.device.type == "cuda":
            packed = {k: v.pin_memory() for k, v in packed.items()}
        return packed

    # -- slots -------------------------------------------------------------------------------
    def slots_for(self, names: Iterable[str | None]) -> list[int]:
        """The slot of each name (``-1`` for None: no adapter), copying adapters that are not
        resident into free or least-recently-used slots not needed by this call."""
        names = list(names)
        wanted = list(dict.fromkeys(n for n in names if n is not None))
        for n in wanted:
            if n not in self._host:
                raise LoRAError(f"no LoRA adapter named {n!r}; loaded: {self.names}")
        if len(wanted) > self.max_loras:
            raise LoRAError(f"a step uses {len(wanted)} adapters but max_loras={self.max_loras} GPU slots exist")
        for n in wanted:
            if n in self._resident:
                self._resident.move_to_end(n)
                continue
            used = set(self._resident.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(v for v in self._resident if v not in wanted)
                slot = self._resident.pop(victim)
            self._resident[n] = slot
            self._copy_in(n, slot)
        return [-1 if n is None else self._resident[n] for n in names]

    def resident(self) -> dict[str, int]:
        """``{name: slot}`` of the adapters now on the device, least recently used first."""
        return dict(self._resident)

    def _copy_in(self, name: str, slot: int) -> None:
        packed = self._host[name]
        for buf_name, buf in self.buffers.items():
            dst = buf[slot] if buf_name.endswith(".A") else buf[:, slot]
            src = packed.get(buf_name)
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src, non_blocking=True)
