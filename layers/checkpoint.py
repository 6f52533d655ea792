"""How a module tree's parameters are filled from checkpoint tensors: a table, derived from layers.

Most parameters are stored under their own name. Fusion-shaped layers pack several checkpoint
tensors into one parameter (q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``, per-expert weights →
one ``[num_experts, ...]`` tensor); such a layer lists its pieces in ``checkpoint_slots()``.
:func:`checkpoint_layout` walks the tree once and returns the full table, keyed by checkpoint name.
"""
from __future__ import annotations

from dataclasses import dataclass

from graphdsl import Module

__all__ = ["CheckpointSlot", "checkpoint_layout"]


@dataclass(frozen=True)
class CheckpointSlot:
    """One checkpoint tensor's place: ``param[index] = tensor`` with ``tensor.shape == shape``.

    ``index`` is a tuple of ints and slices into the parameter (``()``: the whole parameter).
    ``reorder``, when set, is ``(split, dims)``: the checkpoint stores the values in another order,
    and ``param[index] = tensor.reshape(split).permute(dims)`` (flattened back to the target's
    shape). Bloom's ``query_key_value`` rows ``[head, (q|k|v), head_dim]`` become q|k|v that way.
    """

    param: str
    index: tuple
    shape: tuple[int, ...]
    reorder: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    source: tuple = ()
    held: bool = True
    shared: bool = False   # several checkpoint tensors fill the whole parameter and must agree

    def place(self, tensor):
        """``tensor`` (of ``shape``) in the order and shape of ``param[index]``."""
        if self.reorder is None:
            return tensor
        split, dims = self.reorder
        return tensor.reshape(split).permute(dims)


def checkpoint_layout(root: Module, prefix: str = "") -> dict[str, CheckpointSlot]:
    """``{checkpoint name: slot}`` for every parameter of ``root``.

    A module may define ``checkpoint_slots() -> list[(suffix, param_leaf, index, shape[, reorder[, source[, held]]]])]``;
    the leaf is relative to the module's own path, the suffix too, or to its parent's path when the
    module sets ``checkpoint_sources_are_siblings`` (``self_attn.qkv_proj`` packs its siblings
    ``self_attn.q_proj``...). Other parameters map one to one.
    """
    table: dict[str, CheckpointSlot] = {}
    for path, module in root.named_modules(prefix):
        def full(leaf: str) -> str:
            return f"{path}.{leaf}" if path else leaf
        slots = getattr(module, "checkpoint_slots", None)
        if slots is not None:
            parent = path.rpartition(".")[0] if getattr(module, "checkpoint_sources_are_siblings", False) else path
            for suffix, leaf, index, shape, *rest in slots():
                table[f"{parent}.{suffix}" if parent else suffix] = CheckpointSlot(full(leaf), tuple(index),
                                                                                  tuple(shape), *rest)
            continue
        for leaf, p in module._parameters.items():
            table[full(leaf)] = CheckpointSlot(full(leaf), (), tuple(p.shape))
    return table
