"""``PartitionedEngine``: one engine per device part of a :class:`~graphdsl.passes.partition.Partition`,
run in order with the transfers between them.

``forward(inputs)`` takes the step's inputs on the home device (``device``), copies to each part the
inputs it reads, runs the part's engine (its own arena, passes and kernels; a CUDA part is an
ordinary engine, so anything that works for one engine works for the part), copies the tensors the
next parts read (the partition's ``transfer`` nodes: ``x.to(device)``) and returns the graph outputs
on the home device. Weights (and KV caches) are bound per part by name and must already be on the
part's device: the model's loader puts them there (:meth:`FlashCausalLM.parameter_devices`); a
weight on another device is an error, never a silent copy (a copied KV cache would lose writes).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from graphdsl.errors import BindError
from graphdsl.passes.partition import Partition

__all__ = ["PartitionedEngine", "part_device"]


def part_device(label: str) -> torch.device:
    """The torch device of a part label (``cpu:1`` is a second CPU part: tensors live on ``cpu``)."""
    d = torch.device(label)
    return torch.device("cpu") if d.type == "cpu" else d


class PartitionedEngine:
    """Engines of ``partition``'s parts (built with ``build_options``: ``backend``, ...)."""

    def __init__(self, partition: Partition, *, device, **build_options):
        self.partition = partition
        self.net = partition.net
        self.device = torch.device(device)
        self.engines = [p.net.build_engine(device=part_device(p.device), **build_options) for p in partition.parts]
        self.backend = self.engines[0].backend
        self._weights: dict[str, torch.Tensor] = {}
        self.runtime_param_names = sorted({n for e in self.engines for n in e.runtime_param_names})

    @property
    def input_names(self) -> list[str]:
        return list(self.net.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.net.outputs)

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Bind each weight to the parts that read it; it must be on their device."""
        unknown = sorted(k for k in weights if k not in self.net.inputs)
        if unknown:
            raise BindError(f"set_weights: unknown names {unknown}; the graph's inputs are {self.input_names}")
        for part, engine in zip(self.partition.parts, self.engines):
            dev = part_device(part.device)
            mine = {n: w for n, w in weights.items() if n in part.net.inputs}
            for n, w in mine.items():
                if w.device.type != dev.type or (dev.index is not None and w.device.index != dev.index):
                    raise BindError(f"weight '{n}' is read by part {part.index} on {part.device}, but it is on "
                                    f"{w.device}; load it there (placement rules decide where parameters live)")
            if mine:
                engine.set_weights(mine)
        self._weights.update(weights)

    def forward(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor] | None = None,
                runtime_params: Mapping | None = None) -> dict[str, torch.Tensor]:
        unknown = sorted(k for k in inputs if k not in self.net.inputs)
        if unknown:
            raise BindError(f"forward: unknown inputs {unknown}; the graph's inputs are {self.input_names}")
        values: dict[str, torch.Tensor] = dict(inputs)
        params = dict(runtime_params or {})
        for part, engine in zip(self.partition.parts, self.engines):
            feed = self.part_feed(part.index, values)
            mine = {k: v for k, v in params.items() if k in engine.runtime_param_names}
            values.update(engine.forward(feed, None, mine or None))     # on its part's GPU (Engine.forward)
        result = {}
        for name, t in self.net.outputs.items():
            value = values[t.name]
            if outputs is not None and name in outputs:
                result[name] = outputs[name].copy_(value)
            else:
                result[name] = value.to(self.device)
        return result

    __call__ = forward

    def part_feed(self, index: int, values: dict) -> dict[str, torch.Tensor]:
        """Part ``index``'s inputs from ``values`` (the step's inputs and earlier parts' outputs): the
        boundary transfers run here (added to ``values``), then every input it reads but its bound
        weights, on its device."""
        part, engine = self.partition.parts[index], self.engines[index]
        dev = part_device(part.device)
        for t in part.transfers:
            values[t.out] = values[t.src].to(dev)
        return {n: values[n].to(dev) for n in part.net.inputs if n not in engine._weights and n in values}

    def summary(self) -> str:
        lines = [str(self.partition)]
        for engine in self.engines:
            lines.append(engine.summary())
        return "\n".join(lines)

    def dump(self, directory) -> Path:
        """``partitioned.txt`` (the whole graph with its transfer nodes), ``partition.txt`` and one
        folder per part (that engine's own dump)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "partitioned.txt").write_text(str(self.net) + "\n")
        (d / "partition.txt").write_text(str(self.partition) + "\n")
        for part, engine in zip(self.partition.parts, self.engines):
            engine.dump(d / f"part{part.index}_{part.device.replace(':', '')}")
        (d / "summary.txt").write_text(self.summary() + "\n")
        return d
