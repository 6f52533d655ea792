"""Split a recorded network at device boundaries.

Every node gets a device label (``device_of(node)``: a device string such as ``cuda:0``, ``cpu``).
:func:`partition_by_device` returns a :class:`Partition`:

* ``net`` — the whole graph with an explicit ``transfer(x, device=D)`` node wherever a node on
  ``D`` reads a tensor made on another device (one per tensor and device); this is what dumps
  show (``print(partition)``, ``partition.net.dump(...)``);
* ``parts`` — maximal runs of consecutive nodes (record order, which is topological) with one
  label, each its own :class:`~graphdsl.Network`: its inputs are the graph inputs it reads, the
  outputs of the transfers it reads, and tensors of earlier parts on its own device; its outputs
  are what later parts (or transfers) read and the graph outputs it makes. The transfer nodes
  themselves sit between parts: the runtime copies at the boundary
  (:class:`graphdsl.runtime.partitioned.PartitionedEngine`).

Labels are compared as strings, so ``"cpu"`` and ``"cpu:1"`` are two parts (on CPU-only machines
that is how a split is tested); the runtime maps both to the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from graphdsl import Network
from graphdsl.errors import GraphDSLError
from graphdsl.serialize import encode_attr

__all__ = ["Transfer", "Part", "Partition", "partition_by_device"]


@dataclass(frozen=True)
class Transfer:
    """``out = transfer(src, device)``: ``src`` made on another part's device, read on ``device``."""

    out: str
    src: str
    device: str


@dataclass
class Part:
    """One device's run of nodes: ``net`` to build on ``device``; ``transfers`` run just before it."""

    index: int
    device: str
    net: Network
    transfers: list[Transfer] = field(default_factory=list)


@dataclass
class Partition:
    net: Network
    parts: list[Part]

    @property
    def devices(self) -> list[str]:
        return [p.device for p in self.parts]

    def __str__(self) -> str:
        lines = [f"partition of '{self.net.name}': {len(self.parts)} parts on {self.devices}"]
        for p in self.parts:
            ins = [n for n in p.net.inputs if not n.startswith("transfer_")]
            lines.append(f"  part {p.index} on {p.device}: {len(p.net.nodes)} nodes, {len(ins)} inputs, "
                         f"outputs {list(p.net.outputs)}")
            lines += [f"    before it: %{t.out} = transfer(%{t.src}) -> {t.device}" for t in p.transfers]
        return "\n".join(lines)


def partition_by_device(net: Network, device_of: Callable, name: str | None = None) -> Partition:
    """Split ``net`` where ``device_of(node)`` changes (see the module docstring)."""
    obj = net.to_json()
    labels = [str(device_of(n)) for n in net.nodes]
    if not labels:
        raise GraphDSLError(f"partition_by_device: network '{net.name}' has no nodes")
    made_on: dict[str, str] = {}          # tensor name -> label of its producer
    specs: dict[str, dict] = {d["name"]: d for d in obj["inputs"]}
    moved: dict[tuple[str, str], str] = {}
    nodes, node_labels = [], []
    for d, label in zip(obj["nodes"], labels):
        ins = []
        for x in d["inputs"]:
            src = made_on.get(x)
            if src is not None and src != label:
                key = (x, label)
                if key not in moved:
                    t = moved[key] = f"transfer_{len(moved)}"
                    nodes.append({"name": t, "op": "transfer", "inputs": [x],
                                  "outputs": [dict(specs[x], name=t)], "attrs": {"device": encode_attr(label)},
                                  "module": d["module"], "source": "partition_by_device"})
                    node_labels.append(label)
                    specs[t] = nodes[-1]["outputs"][0]
                    made_on[t] = label
                x = moved[key]
            ins.append(x)
        nodes.append(dict(d, inputs=ins))
        node_labels.append(label)
        for o in d["outputs"]:
            specs[o["name"]] = o
            made_on[o["name"]] = label
    full = Network.from_json(dict(obj, nodes=nodes))
    full.name = name or f"{net.name}.partitioned"

    # runs of one label, transfers excluded (they are the boundaries)
    runs: list[tuple[str, list[dict], list[Transfer]]] = []
    pending: list[Transfer] = []
    for d, label in zip(nodes, node_labels):
        if d["op"] == "transfer":
            pending.append(Transfer(d["name"], d["inputs"][0], label))
            continue
        if not runs or runs[-1][0] != label:
            runs.append((label, [], []))
        runs[-1][1].append(d)
        runs[-1][2].extend(pending)
        pending = []
    readers: dict[str, set[int]] = {}
    for i, (_, ds, ts) in enumerate(runs):
        for d in ds:
            for x in d["inputs"]:
                readers.setdefault(x, set()).add(i)
        for t in ts:                       # read at the boundary before run i
            readers.setdefault(t.src, set()).add(i)
    out_tensors = set(obj["outputs"].values())
    inputs = {d["name"]: d for d in obj["inputs"]}
    parts = []
    for i, (label, ds, ts) in enumerate(runs):
        made = {o["name"] for d in ds for o in d["outputs"]}
        read = [x for d in ds for x in d["inputs"] if x not in made]
        part_inputs, seen = [], set()
        for x in read:
            if x in seen:
                continue
            seen.add(x)
            part_inputs.append(inputs[x] if x in inputs else {k: v for k, v in specs[x].items()
                                                              if k in ("name", "shape", "dtype")})
        later = {x for x in made if any(r > i for r in readers.get(x, ()))}
        outs = {x: x for x in sorted(later | (made & out_tensors))}
        sub = {"format": obj["format"], "version": obj["version"], "name": f"{full.name}.part{i}@{label}",
               "inputs": part_inputs, "nodes": ds, "outputs": outs}
        parts.append(Part(i, label, Network.from_json(sub), ts))
    return Partition(full, parts)
