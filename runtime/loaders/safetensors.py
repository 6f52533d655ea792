"""Safetensors weight loading and weight-set checking.

Contract:

- :func:`iter_safetensors` yields ``(name, tensor)`` pairs, one tensor at a time, from a
  ``.safetensors`` file or from a HF model directory (``model.safetensors``, or a sharded
  ``model.safetensors.index.json`` naming its shard files). Files are memory-mapped through
  ``safetensors.safe_open``, so peak memory is one tensor, not the checkpoint. ``dtype`` converts
  floating-point tensors only; integer/bool tensors keep their dtype.
- Anything wrong with the files (missing, truncated, not safetensors, an index naming a missing
  shard or a tensor that its shard lacks) raises one :class:`~graphdsl.GraphDSLError` naming the
  file and what is wrong.
- :func:`iter_safetensors_lazy` yields ``(name, LazyTensor)`` pairs instead: nothing is read until
  the consumer asks for the whole tensor or a slice of it (``safe_open(...).get_slice``), so a
  tensor-parallel rank reads only its own rows or columns; :class:`ReadStats` counts the bytes.
- :func:`check_weights` compares the parameter shapes a model declares with the shapes a
  checkpoint holds and raises one error listing every missing, unexpected and wrong-shape weight.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from graphdsl.errors import GraphDSLError

from .prequantized import STORED_LEAVES

__all__ = ["iter_safetensors", "iter_safetensors_lazy", "LazyTensor", "ReadStats", "safetensors_files",
           "WeightReport", "check_weights"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def safetensors_files(path: str | os.PathLike) -> list[tuple[str, list[str] | None]]:
    """Resolve ``path`` to ``[(file, names_or_None), ...]`` in load order.

    ``names`` is the list of tensor names the index assigns to that shard (None: all of the
    file's tensors, for a single file).
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise GraphDSLError(f"weights path {path!r} must be a .safetensors file or a model "
                                f"directory, got a file with another extension")
        return [(path, None)]
    if not os.path.isdir(path):
        raise GraphDSLError(f"weights path {path!r} does not exist")
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        return _read_index(index)
    single = os.path.join(path, _SINGLE)
    if os.path.isfile(single):
        return [(single, None)]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    raise GraphDSLError(
        f"model directory {path!r} holds neither {_SINGLE!r} nor {_INDEX!r}"
        + (f" (it has {found})" if found else " (no .safetensors files at all)"))


def tensor_names(path: str | os.PathLike) -> list[str]:
    """Every tensor name of the checkpoint at ``path`` (the index's, or each file's header)."""
    from safetensors import safe_open
    out = []
    for file, names in safetensors_files(path):
        if names is None:
            try:
                with safe_open(file, framework="pt") as f:
                    names = list(f.keys())
            except Exception as e:
                raise GraphDSLError(f"{file!r} is not a readable safetensors file: {_why(e)}") from None
        out += names
    return out


def _read_index(index: str) -> list[tuple[str, list[str] | None]]:
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphDSLError(f"cannot read safetensors index {index!r}: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise GraphDSLError(f"safetensors index {index!r} must hold a 'weight_map' object "
                            f"mapping tensor names to shard file names")
    root = os.path.dirname(index)
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    out = []
    for shard, names in shards.items():
        file = os.path.join(root, shard)
        if not os.path.isfile(file):
            raise GraphDSLError(f"safetensors index {index!r} names shard {shard!r} "
                                f"(for {len(names)} tensors, e.g. {names[0]!r}), "
                                f"but {file!r} does not exist")
        out.append((file, names))
    return out


def iter_safetensors(path: str | os.PathLike, *,
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a safetensors checkpoint, lazily.

    ``path``: a ``.safetensors`` file, or a directory with ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``. ``dtype``: if given, floating-point tensors are converted
    to it (others are left alone). Tensors are on the CPU.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise GraphDSLError(f"iter_safetensors: dtype must be a torch.dtype or None, got {dtype!r}")
    for file, names in safetensors_files(path):
        yield from _iter_file(file, names, dtype)


def _iter_file(file: str, names: list[str] | None,
               dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, or a panic surfaced as an exception
        raise GraphDSLError(f"{file!r} is not a readable safetensors file: {_why(e)}") from None
    with handle as f:
        present = set(f.keys())
        if names is None:
            names = list(f.keys())
        else:
            missing = [n for n in names if n not in present]
            if missing:
                raise GraphDSLError(
                    f"safetensors shard {file!r} lacks {len(missing)} tensors that the index "
                    f"assigns to it: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        for name in names:
            try:
                t = f.get_tensor(name)
            except Exception as e:
                raise GraphDSLError(
                    f"cannot read tensor {name!r} from {file!r}: {_why(e)}") from None
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t


@dataclass
class ReadStats:
    """Bytes and tensors read from checkpoint files (in the files' dtypes)."""

    bytes: int = 0
    tensors: int = 0


class LazyTensor:
    """One checkpoint tensor not read yet: ``shape`` (a tuple), ``dtype`` (torch), and :meth:`read`."""

    def __init__(self, name: str, file: str, handle, dtype: torch.dtype | None, stats: ReadStats | None):
        self.name, self.file, self._handle, self._cast, self._stats = name, file, handle, dtype, stats
        try:
            self._slice = handle.get_slice(name)
            self.shape = tuple(self._slice.get_shape())
        except Exception as e:
            raise GraphDSLError(f"cannot read tensor {name!r} from {file!r}: {_why(e)}") from None

    def read(self, index: tuple = ()) -> torch.Tensor:
        """The tensor, or its part ``index`` (a tuple of slices, ints), as a CPU tensor; only that
        part's bytes are read from the memory-mapped file."""
        try:
            t = self._slice[index] if index else self._handle.get_tensor(self.name)
        except Exception as e:
            raise GraphDSLError(f"cannot read tensor {self.name!r}{list(index) if index else ''} from "
                                f"{self.file!r}: {_why(e)}") from None
        if self._stats is not None:
            self._stats.bytes += t.numel() * t.element_size()
            self._stats.tensors += 1
        if self._cast is not None and t.is_floating_point() and t.dtype != self._cast:
            t = t.to(self._cast)
        return t


def iter_safetensors_lazy(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                          stats: ReadStats | None = None) -> Iterator[tuple[str, LazyTensor]]:
    """Like :func:`iter_safetensors`, but yields :class:`LazyTensor` handles (valid while iterating)
    and reads nothing by itself; ``stats`` adds up what the consumer reads."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise GraphDSLError(f"iter_safetensors_lazy: dtype must be a torch.dtype or None, got {dtype!r}")
    from safetensors import safe_open
    for file, names in safetensors_files(path):
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except Exception as e:
            raise GraphDSLError(f"{file!r} is not a readable safetensors file: {_why(e)}") from None
        with handle as f:
            present = list(f.keys())
            if names is not None:
                missing = [n for n in names if n not in set(present)]
                if missing:
                    raise GraphDSLError(
                        f"safetensors shard {file!r} lacks {len(missing)} tensors that the index "
                        f"assigns to it: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
            for name in (present if names is None else names):
                yield name, LazyTensor(name, file, f, dtype, stats)


def _why(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


@dataclass
class WeightReport:
    """Differences between the weights a model expects and those a checkpoint holds."""

    missing: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    unexpected: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @classmethod
    def compare(cls, expected: dict[str, tuple[int, ...]],
                got: dict[str, tuple[int, ...]]) -> "WeightReport":
        r = cls()
        for name, shape in expected.items():
            if name not in got:
                r.missing.append((name, tuple(shape)))
            elif tuple(got[name]) != tuple(shape):
                r.wrong_shape.append((name, tuple(shape), tuple(got[name])))
        r.unexpected = [(n, tuple(s)) for n, s in got.items() if n not in expected]
        return r

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape)

    def __str__(self) -> str:
        lines = []
        if self.missing:
            lines.append(f"{len(self.missing)} missing (expected by the model, not in checkpoint):")
            lines += _first([f"  {n}: expected shape {list(s)}" for n, s in self.missing])
        if self.unexpected:
            lines.append(f"{len(self.unexpected)} unexpected (in checkpoint, not in the model):")
            lines += _first([f"  {n}: shape {list(s)}" for n, s in self.unexpected])
        if self.wrong_shape:
            lines.append(f"{len(self.wrong_shape)} with wrong shape:")
            lines += _first([f"  {n}: expected shape {list(e)}, got {list(g)}" for n, e, g in self.wrong_shape])
        stored = [n for n, _ in self.unexpected if n.rpartition(".")[2] in STORED_LEAVES]
        if stored:
            lines.append(f"hint: the checkpoint holds quantized tensors ({stored[0]!r}, ...) that the model does not "
                         "expect: a pre-quantized checkpoint needs the quantization_config of its config.json "
                         "(compressed-tensors, AWQ or GPTQ)")
        return "\n".join(lines) if lines else "weights match"


_LISTED = 40          # names a WeightReport lists of each kind before "... and N more"


def _first(lines: list[str]) -> list[str]:
    return lines if len(lines) <= _LISTED else lines[:_LISTED] + [f"  ... and {len(lines) - _LISTED} more"]


def check_weights(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> None:
    """Raise one :class:`GraphDSLError` listing every missing, unexpected or wrong-shape weight."""
    report = WeightReport.compare(expected, got)
    if not report.ok:
        raise GraphDSLError(f"checkpoint weights do not match the model:\n{report}")
