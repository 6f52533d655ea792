"""Decode through per-part CUDA graphs for a partitioned model (placement rules, a ``transfer_map``).

A :class:`~graphdsl.runtime.partitioned.PartitionedEngine` runs one engine per device part. Each
CUDA part keeps its own CUDA graphs (a :class:`~graphdsl.runtime.serving.cuda_graphs.CudaGraphRunner`
per part on the ``triton`` backend, keyed by batch bucket like a single-device model): its inputs are the step's decode
inputs (padded as :func:`~graphdsl.models.base.decode_pads` says) and the tensors other parts hand
it (batch-major hidden states, padded with zeros), so a steady decode step is one replay per CUDA
part plus the boundary copies between them; host parts run eagerly. A part whose capture fails
(an output that is not batch-major) runs eagerly from then on.
"""
from __future__ import annotations

from typing import Mapping

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.device import on_device
from graphdsl.runtime.partitioned import PartitionedEngine, part_device
from graphdsl.runtime.serving.cuda_graphs import BUCKETS, CudaGraphRunner, Pad

__all__ = ["PartitionedGraphRunner"]


class PartitionedGraphRunner:
    """The decode runner of a partitioned engine: ``pads`` (the step inputs it takes), ``fits(step)``
    and ``run(step) -> {"logits": ...}``, as :class:`CudaGraphRunner` offers them."""

    def __init__(self, engine: PartitionedEngine, step_pads: Mapping[str, Pad], *, buckets=BUCKETS):
        self.engine, self.buckets = engine, tuple(buckets)
        self.pads = {k: p for k, p in step_pads.items() if k in engine.net.inputs and k not in engine._weights}
        self.runners: list[CudaGraphRunner | None] = []
        for part, eng in zip(engine.partition.parts, engine.engines):
            if part_device(part.device).type != "cuda" or eng.backend.name != "triton":
                self.runners.append(None)
                continue
            pads = {n: step_pads.get(n, Pad(0)) for n in part.net.inputs if n not in eng._weights}
            self.runners.append(CudaGraphRunner(eng, pads, buckets=self.buckets))

    def fits(self, step: Mapping[str, torch.Tensor]) -> bool:
        """A batch within the largest bucket, fixed-width inputs within their width."""
        n = next(iter(step.values())).shape[0] if step else 0
        if not 1 <= n <= self.buckets[-1]:
            return False
        return all(p.width is None or (step[k].dim() == 2 and step[k].shape[1] <= p.width)
                   for k, p in self.pads.items() if k in step)

    def run(self, step: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        engine = self.engine
        values = dict(step)
        for i, (part, eng) in enumerate(zip(engine.partition.parts, engine.engines)):
            feed = engine.part_feed(i, values)
            runner = self.runners[i]
            with on_device(part_device(part.device)):
                out = None
                if runner is not None:
                    try:
                        out = runner.run(feed)
                    except GraphDSLError:
                        self.runners[i] = None          # not capturable (an output is not batch-major)
                if out is None:
                    out = eng.forward(feed)
            values.update(out)
        return {name: values[t.name].to(engine.device) for name, t in engine.net.outputs.items()}
