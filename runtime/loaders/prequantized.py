"""Pre-quantized HF checkpoints: read ``config.json``'s ``quantization_config`` and convert the stored
tensors into graphdsl's scheme layouts (:mod:`graphdsl.quant`) while they stream in.

Formats (``quant_method`` / ``format``) and the scheme each linear takes:

* ``compressed-tensors`` ``pack-quantized`` — int4: ``weight_packed`` int32 ``[out, in/8]`` holds 8
  consecutive inputs per word, value ``q + 8`` at bits ``4i`` (little end first), so on a
  little-endian host its bytes *are* our ``_packed`` (even ``k`` in the low nibble, ``code = q + 8``);
  ``weight_zero_point`` (asymmetric) int32 ``[ceil(out/8), groups]`` packs 8 output rows per word the
  same way. ``W = (q - zp) * s`` becomes ``int4-g{g}`` (``z = 8``) or ``int4-g{g}-zp`` with
  ``z = zp + 8``. int8: 4 bytes per word, ``q + 128`` each → ``int8-channel`` (symmetric only).
* compressed-tensors ``actorder``: ``static`` / ``weight`` keep contiguous groups (nothing to do);
  the older ``group`` / ``dynamic`` store ``weight_g_idx [in]`` like GPTQ's ``g_idx``, and int4 group
  weights take the ``-act`` scheme as GPTQ act-order does (below).
* ``compressed-tensors`` ``naive-quantized`` / ``int-quantized`` — ``weight`` int8 ``[out, in]``
  (int4 values in -8..7, or int8) with the same scales and zero points, unpacked.
* ``compressed-tensors`` ``float-quantized`` — ``weight`` float8 e4m3 with a per-tensor or
  per-channel ``weight_scale`` → ``fp8-channel`` (a per-tensor scale is repeated per row, which is
  exact and lets q/k/v pieces of one fused linear keep their own scales); dynamic per-token fp8
  activations → ``fp8-channel-dyn``.
* ``awq`` (AutoAWQ GEMM) — ``qweight`` int32 ``[in, out/8]``, nibble ``i`` of a word holding output
  column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its 8; ``qzeros`` int32 ``[in/g, out/8]`` in the same
  order; ``scales [in/g, out]``; ``W = (q - z) * s`` → ``int4-g{g}-zp``.
* ``gptq`` (AutoGPTQ / GPTQModel) — ``qweight`` int32 ``[in/8, out]``, nibble ``i`` of word ``r``
  holding input ``8r + i``; ``qzeros`` int32 ``[in/g, out/8]`` sequential; ``scales [in/g, out]``;
  ``g_idx [in]``. ``W = (q - z) * s`` with ``z = stored + 1`` for ``checkpoint_format`` ``gptq``
  (v1, what transformers/optimum convert on load) and ``z = stored`` for ``gptq_v2``; ``sym`` true →
  ``int4-g{g}`` (every ``z`` must be 8), else ``int4-g{g}-zp``. Act-order (``desc_act``): ``g_idx``
  assigns inputs to groups in another order; the scheme takes ``-act`` (``int4-g128-zp-act``), the
  codes' columns are stored in ``argsort(g_idx)`` order with that order as companion ``_perm``, and
  q/k/v (gate/up) of one fused linear must share it (they share their input).

Per-channel int4 (one group over all inputs) takes groups of 128 (64, 32) with the scale repeated,
exactly. Anything else — other bit widths, group sizes, block or static-activation schemes — is a
:class:`~graphdsl.GraphDSLError` naming the tensor and the scheme.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.quant import Fp8Scheme, IntScheme, QuantScheme, pack_int4, unpack_int4

__all__ = ["CheckpointQuantization", "read_checkpoint_quantization", "SUPPORTED", "STORED_METHODS", "STORED_LEAVES"]

SUPPORTED = {
    ("compressed-tensors", "pack-quantized"): "int4-g{32,64,128}[-zp], int8-channel",
    ("compressed-tensors", "naive-quantized"): "int4-g{32,64,128}[-zp], int8-channel",
    ("compressed-tensors", "int-quantized"): "int4-g{32,64,128}[-zp], int8-channel",
    ("compressed-tensors", "float-quantized"): "fp8-channel, fp8-channel-dyn",
    ("awq", "gemm"): "int4-g{32,64,128}-zp",
    ("gptq", "gptq"): "int4-g{32,64,128}[-zp][-act]",
}
#: the ``quant_method`` names of the formats above: vLLM's ``quantization=`` values for them, which
#: ``LLM(quantization=)`` accepts for a checkpoint stored in that format
STORED_METHODS = tuple(sorted({m for m, _ in SUPPORTED}))
_GROUPS = (128, 64, 32)
_CT_STATIC_ORDER = ("static", "weight")     # compressed-tensors actorder with contiguous groups: no g_idx
_CT_GROUP_ORDER = ("group", "dynamic")      # ... with a weight_g_idx per input (the -act schemes)
_CT_STRATEGIES = (None, "tensor", "channel", "group")   # weight strategies that load (not block, tensor_group, ...)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # nibble i of an AWQ word holds column _AWQ_ORDER[i] of its 8


# the tensor leaves a quantized module stores, per format (``CheckpointQuantization.leaves``)
_CT_LEAVES = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
_AWQ_LEAVES = ("qweight", "qzeros", "scales")
_GPTQ_LEAVES = ("qweight", "qzeros", "scales", "g_idx")
#: leaves that only a quantized module stores (a plain ``weight`` is not one)
STORED_LEAVES = frozenset(_CT_LEAVES + _AWQ_LEAVES + _GPTQ_LEAVES) - {"weight"}


def read_checkpoint_quantization(hf_config: dict) -> "CheckpointQuantization | None":
    """The checkpoint's quantization (None when ``config.json`` has no ``quantization_config``);
    an unsupported ``quant_method`` or format is an error naming it and the supported ones."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise GraphDSLError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        for key, what in (("sparsity_config", "sparse weights"), ("kv_cache_scheme", "a quantized KV cache"),
                          ("transform_config", "weight transforms (rotations)")):
            if qc.get(key) and not (key == "sparsity_config" and qc[key].get("format") in (None, "dense")):
                raise GraphDSLError(f"config.json: compressed-tensors quantization_config.{key} ({what}) is not "
                                    f"supported, got {qc[key]!r}")
        return _CompressedTensors.parse(qc)
    if method == "awq":
        return _Awq.parse(qc)
    if method == "gptq":
        return _Gptq.parse(qc)
    raise GraphDSLError(f"config.json: quantization_config.quant_method {qc.get('quant_method')!r} is not supported; "
                        f"pre-quantized checkpoints load from {sorted({m for m, _ in SUPPORTED})}")


@dataclass
class CheckpointQuantization:
    """A checkpoint's quantization: which linear (HF module name) takes which scheme, and the
    conversion of its stored tensors into that scheme's companions.

    Subclasses define :meth:`describe`, :meth:`_scheme` (``None``: the module is stored
    unquantized), :meth:`_required` (the tensor leaves of one quantized module, all present before
    it converts), :meth:`_convert`, and set ``leaves`` (every leaf a quantized module may store),
    ``optional`` (leaves that may be absent) and ``refused`` (leaf -> why it cannot load)."""

    method: str = ""
    leaves: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    refused: dict = field(default_factory=dict)
    _chosen: dict = field(default_factory=dict)
    #: graphdsl's module name -> the checkpoint's (before the model's renames): the config's module
    #: patterns (``ignore``, ``targets``, ``modules_to_not_convert``) are written against the latter
    originals: dict = field(default_factory=dict)
    #: quantized linears whose weight the model holds in its dtype (a weight used outside a linear,
    #: MLA's ``kv_b_proj``): their companions are dequantized as they load, into ``<module>.weight``
    dense: set = field(default_factory=set)

    def describe(self, module: str) -> str:
        """How the checkpoint stores ``module`` (for messages)."""
        return self.method

    def source_module(self, module: str) -> str:
        """The checkpoint's name of graphdsl's ``module`` (itself when not renamed or not known)."""
        return self.originals.get(module, module)

    def scheme_for(self, module: str, out_features: int, in_features: int) -> QuantScheme | None:
        """Our scheme for the HF linear ``module`` of ``[out, in]`` (None: stored in full precision)."""
        scheme = self._scheme(module, in_features)
        self._chosen[module] = (scheme, out_features, in_features)
        return scheme

    def convert(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                rename: Callable[[str], str] = lambda name: name) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's ``(name, tensor)`` pairs (names passed through ``rename``, the model's
        checkpoint renames, first) with each quantized module's tensors replaced by our companions
        ``<module>.weight<suffix>``, and other floating-point tensors cast to ``dtype``. Call after
        :meth:`scheme_for` has seen every linear. A module's tensors are held only until its last
        one arrives. A quantized tensor of a module that is no linear graphdsl quantizes (an
        embedding, say) is an error naming it."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        seen = set()
        for name, t in tensors:
            name = rename(name)
            module, leaf, error = self._role(name)
            if error is not None:
                raise GraphDSLError(error)
            if module is not None:
                seen.add(module)
                if leaf not in self._required(module):      # a leaf this module's layout does not read
                    error = self._unread(module, leaf, name, t)
                    if error is not None:
                        raise GraphDSLError(error)
                    continue
                got = pending.setdefault(module, {})
                got[leaf] = t
                if all(p in got for p in self._required(module)):
                    yield from self._emit(module, pending.pop(module), dtype)
                continue
            yield name, (t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
        for module, (scheme, _, _) in self._chosen.items():
            if scheme is not None and (module in pending or module not in seen):
                error = self._missing(module, pending.get(module, {}))
                if error is not None:
                    raise GraphDSLError(error)
                if module in pending:
                    yield from self._emit(module, pending[module], dtype)

    def check_names(self, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], list[str]]:
        """What :meth:`convert` would say of a checkpoint from its tensor names alone (``graphdsl
        check``): ``shapes`` (checkpoint name, renamed, -> shape) with each quantized module's stored
        tensors replaced by ``<module>.weight`` of its logical ``[out, in]`` shape, and the errors
        :meth:`convert` would raise (refused or missing tensors, quantized tensors of a module left
        unquantized). Call after :meth:`scheme_for` has seen every linear; the stored tensors'
        shapes are checked only when they convert."""
        out, problems, pending = {}, [], {}
        for name, shape in shapes.items():
            module, leaf, error = self._role(name)
            if error is not None:
                problems.append(error)
            elif module is not None and leaf not in self._required(module):
                error = self._unread(module, leaf, name, torch.empty(shape, device="meta"))
                if error is not None:
                    problems.append(error)
            elif module is not None:
                pending.setdefault(module, {})[leaf] = shape
            else:
                out[name] = shape
        for module, (scheme, out_features, in_features) in self._chosen.items():
            if scheme is None:
                continue
            error = self._missing(module, pending.get(module, {}))
            if error is not None:
                problems.append(error)
            if module in pending:
                if f"{module}.weight" in out:          # a full-precision copy beside the stored tensors
                    problems.append(f"checkpoint tensor {module + '.weight'!r} is unexpected: {module!r} is stored "
                                    f"quantized ({self.describe(module)})")
                out[f"{module}.weight"] = (out_features, in_features)
        return out, problems

    def _role(self, name: str) -> tuple[str | None, str, str | None]:
        """``(module, leaf, error)`` of checkpoint tensor ``name``: ``module`` set when the tensor is
        one that a quantized module stores, ``error`` when the tensor cannot load."""
        module, _, leaf = name.rpartition(".")
        chosen = self._chosen.get(module)
        if chosen is not None and chosen[0] is not None:
            if leaf in self.refused:
                return None, leaf, f"checkpoint tensor {name!r} ({self.describe(module)}): {self.refused[leaf]}"
            if leaf in self.leaves:
                return module, leaf, None
        elif leaf in self.leaves and leaf != "weight":
            why = (f"the quantization_config leaves {module!r} unquantized" if chosen is not None else
                   f"{module!r} is not a linear graphdsl loads quantized (the attention and MLP projections and "
                   "the MoE experts are; embeddings and routers are not)")
            return None, leaf, f"checkpoint tensor {name!r} is stored quantized ({self.method}), but {why}"
        return None, leaf, None

    def _missing(self, module: str, got) -> str | None:
        """The error for a quantized module whose stored tensors ``got`` (by leaf) lack a required one."""
        missing = [p for p in self._required(module) if p not in got and p not in self.optional]
        if missing:
            return (f"quantized linear {module!r} ({self.describe(module)}): the checkpoint lacks "
                    f"{[f'{module}.{p}' for p in missing]}")
        return None

    def _emit(self, module, got, dtype):
        scheme, out_features, in_features = self._chosen[module]
        stored = self._convert(module, scheme, got, out_features, in_features)
        out = []
        for c, t in zip(scheme.companions(out_features, in_features), stored):
            full = f"{module}.weight{c.suffix}"
            if tuple(t.shape) != c.shape:
                raise GraphDSLError(f"quantized linear {module!r} ({self.describe(module)} as {scheme.name}): "
                                    f"tensor {full!r} converts to {list(t.shape)}, expected {list(c.shape)}")
            if t.dtype in (torch.float16, torch.bfloat16, torch.float32) and not _meta(t) \
                    and not bool(torch.isfinite(t).all()):
                raise GraphDSLError(f"quantized linear {module!r} ({self.describe(module)}): its {c.suffix[1:]} "
                                    f"({full!r}) holds {int((~torch.isfinite(t)).sum())} values that are NaN or "
                                    "infinite; the checkpoint is damaged")
            out.append((full, t.to(c.dtype or dtype).contiguous()))
        if module in self.dense and not any(_meta(t) for _, t in out):
            yield f"{module}.weight", scheme.dequantize([t for _, t in out], out_features, in_features, dtype)
        elif module in self.dense:                       # shapes only (check): the dense weight's
            yield f"{module}.weight", torch.empty(out_features, in_features, dtype=dtype, device="meta")
        else:
            yield from out

    def _required(self, module: str) -> tuple[str, ...]:
        return tuple(p for p in self.leaves)

    def _unread(self, module: str, leaf: str, name: str, t: torch.Tensor) -> str | None:
        """The error for stored tensor ``name`` of quantized ``module`` whose ``leaf`` its layout does
        not read (not in :meth:`_required`); None when it says nothing the layout does not (a
        symmetric layout's all-zero zero points, as older compressed-tensors wrote them)."""
        scheme = self._chosen[module][0]
        return (f"checkpoint tensor {name!r} ({self.describe(module)}): quantized linear {module!r} loads as "
                f"{scheme.name}, whose stored layout has no {leaf!r} (layout mismatch)")

    def _scheme(self, module: str, in_features: int) -> QuantScheme | None:
        raise NotImplementedError

    def _convert(self, module, scheme, got, out_features, in_features) -> list[torch.Tensor]:
        raise NotImplementedError


# -- helpers ------------------------------------------------------------------------------------------
def _int4_scheme(where: str, group: int | None, in_features: int, zero_point: bool) -> IntScheme:
    """``int4-g{group}[-zp]``; ``group`` None (one group per channel): the largest of 128/64/32
    dividing the inputs, with the scale repeated."""
    if group is None or group == -1 or group == in_features:
        group = next((g for g in _GROUPS if in_features % g == 0), None)
        if group is None:
            raise GraphDSLError(f"{where}: per-channel int4 over {in_features} inputs needs a group of "
                                f"{list(_GROUPS)} dividing them")
    if group not in _GROUPS:
        raise GraphDSLError(f"{where}: int4 group_size {group} is not supported (supported: {sorted(_GROUPS)}, "
                            "or per-channel)")
    if in_features % group:
        raise GraphDSLError(f"{where}: {in_features} inputs are not a multiple of the group size {group}")
    return IntScheme(4, group, zero_point)


def _per_group(t: torch.Tensor, out_features: int, groups: int, what: str, stored: int | None = None) -> torch.Tensor:
    """``t`` as ``[out, groups]``. ``stored``: the groups the checkpoint's layout holds (default
    ``groups``); one (per channel: ``[out, 1]``, ``[out]``, or per tensor: ``[1]``, ``[]``) is
    repeated across the groups, exactly. Any other shape is a layout mismatch."""
    stored = groups if stored is None else stored
    if stored == 1 and t.numel() == 1:
        t = t.reshape(1, 1)
    elif stored == 1 and t.dim() == 1 and t.shape[0] == out_features:
        t = t[:, None]
    if t.dim() != 2 or t.shape[1] != stored or t.shape[0] not in ((1, out_features) if stored == 1 else (out_features,)):
        raise GraphDSLError(f"{what} has shape {list(t.shape)}; the layout expects [{out_features}, {stored}]"
                            + (" (or per-tensor [1])" if stored == 1 else ""))
    return t.expand(out_features, stored).repeat_interleave(groups // stored, dim=1)


def _int32_bytes(t: torch.Tensor) -> torch.Tensor:
    """An int32 ``[r, c]`` tensor's bytes ``[r, 4c]`` in memory order (word ``w``'s byte ``b`` at ``4w + b``)."""
    if sys.byteorder != "little":
        raise GraphDSLError("packed int32 checkpoints load only on little-endian hosts")
    return t.contiguous().view(torch.uint8)


def _nibbles(t: torch.Tensor) -> torch.Tensor:
    """int32 ``[r, c]`` -> uint8 ``[r, 8c]``: nibble ``i`` (bits ``4i..4i+3``) of word ``c`` at ``8c + i``."""
    b = _int32_bytes(t)
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(t.shape[0], -1)


def _meta(t: torch.Tensor) -> bool:
    """Whether ``t`` is a header only (``graphdsl check`` converts meta tensors: shapes and dtypes are
    checked, the checks of stored values are left to the load)."""
    return t.device.type == "meta"


def _check_float(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` when it holds floating-point values (a scale); an integer tensor is a layout mismatch,
    not values to cast (an int32 scale would silently scale the weight by whole numbers)."""
    if not t.is_floating_point():
        raise GraphDSLError(f"{what} should be a floating-point tensor, got {t.dtype}")
    return t


def _check_int(t: torch.Tensor, shape: tuple, what: str, dtype=torch.int32) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise GraphDSLError(f"{what} should be {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
    return t


def _typed(d: dict, key: str, kind: type, default, where: str, *, alias: str | None = None):
    """``d[key]`` (or ``d[alias]``; ``default`` when absent or null), refused unless a ``kind`` (a
    bool is no int here): config.json values of the wrong JSON type would be misread ("false" as true)."""
    name, v = key, d.get(key)
    if v is None and alias is not None:
        name, v = alias, d.get(alias)
    if v is None:
        return default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        want = {bool: "true or false", int: "an integer"}.get(kind, kind.__name__)
        raise GraphDSLError(f"config.json: {where}.{name} must be {want}, got {v!r}")
    return v


# -- compressed-tensors ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _CtGroup:
    targets: tuple[str, ...]
    fmt: str
    weights: dict
    activations: dict | None


@dataclass
class _CompressedTensors(CheckpointQuantization):
    groups: tuple = ()
    ignore: tuple = ()

    @classmethod
    def parse(cls, qc: dict) -> "_CompressedTensors":
        top = qc.get("format")
        groups = []
        for gname, g in (qc.get("config_groups") or {}).items():
            if not isinstance(g, dict):
                raise GraphDSLError(f"quantization_config.config_groups.{gname} must be an object, got {g!r}")
            fmt = g.get("format") or top
            if fmt not in ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized"):
                raise GraphDSLError(f"quantization_config.config_groups.{gname}: compressed-tensors format {fmt!r} is "
                                    f"not supported (supported: pack-quantized, naive-quantized, int-quantized, "
                                    f"float-quantized)")
            weights = dict(g.get("weights") or {})
            where = f"quantization_config.config_groups.{gname}.weights"
            _typed(weights, "num_bits", int, None, where)
            _typed(weights, "group_size", int, None, where)
            _typed(weights, "symmetric", bool, True, where)
            groups.append(_CtGroup(tuple(g.get("targets") or ()), fmt, weights, g.get("input_activations")))
        return cls(method="compressed-tensors", groups=tuple(groups), ignore=tuple(qc.get("ignore") or ()),
                   leaves=_CT_LEAVES,
                   optional=("weight_shape",),
                   refused={"input_scale": "static activation scales are not supported (dynamic per-token fp8 or "
                                           "weight-only schemes are)"})

    def describe(self, module):
        g = self._group(module)
        if g is None:
            return "compressed-tensors"
        w = g.weights
        return (f"compressed-tensors {g.fmt} {w.get('type')}{w.get('num_bits')} {w.get('strategy')}"
                f"{'' if w.get('group_size') in (None, -1) else ' g' + str(w.get('group_size'))}"
                f"{'' if w.get('symmetric', True) else ' asymmetric'}")

    def _group(self, module: str) -> _CtGroup | None:
        module = self.source_module(module)
        if any(_ct_match(module, t) for t in self.ignore):
            return None
        return next((g for g in self.groups if any(t == "Linear" or _ct_match(module, t) for t in g.targets)), None)

    def _scheme(self, module, in_features):
        g = self._group(module)
        if g is None:
            return None
        where = f"quantized linear {module + '.weight'!r} ({self.describe(module)})"
        w, a = g.weights, g.activations
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        order = w.get("actorder")
        if strategy not in _CT_STRATEGIES or order not in (None, False) + _CT_STATIC_ORDER + _CT_GROUP_ORDER:
            raise GraphDSLError(f"{where}: weight strategy {strategy!r}"
                                f"{'' if not order else ', actorder ' + repr(order)} is not supported (strategies "
                                f"{[x for x in _CT_STRATEGIES if x]}; actorder "
                                f"{list(_CT_STATIC_ORDER + _CT_GROUP_ORDER)} or none)")
        if order in _CT_GROUP_ORDER and not (bits == 4 and kind == "int" and strategy == "group"):
            raise GraphDSLError(f"{where}: actorder {order!r} (a weight_g_idx per input) applies to int4 group "
                                f"weights, got {kind}{bits} strategy {strategy!r}")
        if kind == "float":
            if bits != 8 or g.fmt != "float-quantized" or strategy not in ("tensor", "channel"):
                raise GraphDSLError(f"{where}: only float8 weights (float-quantized, per-tensor or per-channel) "
                                    "are supported")
            dyn = False
            if a is not None:
                if not (a.get("type") == "float" and a.get("num_bits") == 8 and a.get("dynamic") in (True, "true")
                        and a.get("strategy") == "token"):
                    raise GraphDSLError(f"{where}: input activations {a!r} are not supported (only dynamic per-token "
                                        "float8, which becomes fp8-channel-dyn)")
                dyn = True
            return Fp8Scheme(per_channel=True, dynamic_activations=dyn)
        if a is not None:
            raise GraphDSLError(f"{where}: quantized input activations {a!r} are not supported with integer "
                                "weights (weight-only schemes are)")
        if g.fmt == "float-quantized" or kind != "int":
            raise GraphDSLError(f"{where}: weight type {kind!r} in format {g.fmt!r} is not supported")
        sym = w.get("symmetric", True)
        if bits == 8:
            if not sym or strategy not in ("channel", "tensor"):
                raise GraphDSLError(f"{where}: int8 weights load as int8-channel, which is symmetric and per-channel "
                                    f"(got strategy {strategy!r}, symmetric={sym})")
            return IntScheme(8, None, False)
        if bits == 4:
            group = w.get("group_size") if strategy == "group" else None
            scheme = _int4_scheme(where, group, in_features, not sym)
            return replace(scheme, act_order=True) if order in _CT_GROUP_ORDER else scheme
        raise GraphDSLError(f"{where}: {bits}-bit integer weights are not supported (4 or 8 bits)")

    def _required(self, module):
        g = self._group(module)
        data = ("weight_packed", "weight_shape") if g.fmt == "pack-quantized" else ("weight",)
        zp = () if g.weights.get("symmetric", True) or g.weights.get("type") == "float" else ("weight_zero_point",)
        order = ("weight_g_idx",) if g.weights.get("actorder") in _CT_GROUP_ORDER else ()
        return ("weight_scale",) + data + zp + order

    def _unread(self, module, leaf, name, t):
        scheme, n, k = self._chosen[module]
        where = f"quantized linear {module!r} ({self.describe(module)})"
        if leaf == "weight_shape":
            if not _meta(t) and [int(x) for x in t.reshape(-1).tolist()] != [n, k]:
                return f"{where}: {name!r} is {t.tolist()}, the model expects [{n}, {k}]"
            return None
        if leaf == "weight_zero_point" and not getattr(scheme, "zero_point", False):
            if not _meta(t) and bool((t.float() != 0).any()):
                return (f"{where}: {name!r} holds zero points other than 0 although the config says symmetric "
                        "(layout mismatch)")
            return None                                   # symmetric: the zero points older files store, all 0
        if leaf == "weight_g_idx" and isinstance(scheme, IntScheme) and scheme.bits == 4:
            try:
                stored = scheme.groups(k) if self._group(module).weights.get("strategy") == "group" else 1
                _input_order(t, k, stored, f"{where}: {name!r}", False)     # must be the trivial order
            except GraphDSLError as e:
                return str(e)
            return None
        return super()._unread(module, leaf, name, t)

    def _convert(self, module, scheme, got, n, k):
        g = self._group(module)
        where = f"quantized linear {module!r} ({self.describe(module)})"
        if "weight_shape" in got and not _meta(got["weight_shape"]) and \
                [int(x) for x in got["weight_shape"].tolist()] != [n, k]:
            raise GraphDSLError(f"{where}: {module + '.weight_shape'!r} is {got['weight_shape'].tolist()}, the model "
                                f"expects [{n}, {k}]")
        scale_name = f"{module}.weight_scale"
        if isinstance(scheme, Fp8Scheme):
            w = got["weight"]
            if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != (n, k):
                raise GraphDSLError(f"{where}: {module + '.weight'!r} should be [{n}, {k}] torch.float8_e4m3fn, "
                                    f"got {list(w.shape)} {w.dtype}")
            scale = _check_float(got["weight_scale"], f"{where}: {scale_name!r}")
            return [w, _per_group(scale.float(), n, 1, f"{where}: {scale_name!r}")]
        groups = scheme.groups(k)
        stored = groups if g.weights.get("strategy") == "group" else 1
        scale = _per_group(_check_float(got["weight_scale"], f"{where}: {scale_name!r}"), n, groups,
                           f"{where}: {scale_name!r}", stored)
        if g.fmt == "pack-quantized":
            words = k * scheme.bits // 32
            packed = _check_int(got["weight_packed"], (n, words), f"{where}: {module + '.weight_packed'!r}")
            codes = _int32_bytes(packed)                  # int8: byte = q + 128; int4: already our nibbles
            if scheme.bits == 8:
                return [(codes.to(torch.int16) - 128).to(torch.int8), scale]
            out = [codes, scale]
        else:
            q = _check_int(got["weight"], (n, k), f"{where}: {module + '.weight'!r}", torch.int8)
            if scheme.bits == 8:
                return [q, scale]
            out = [pack_int4((q.to(torch.int16) + 8).to(torch.uint8)), scale]
        if scheme.act_order:                   # each group's inputs side by side, that order kept as _perm
            perm = _input_order(got["weight_g_idx"], k, groups, f"{where}: {module + '.weight_g_idx'!r}", True)
            out[0] = pack_int4(unpack_int4(out[0])[:, perm])
        if scheme.zero_point:
            zp = got["weight_zero_point"]
            zname = f"{where}: {module + '.weight_zero_point'!r}"
            if g.fmt == "pack-quantized":
                zp = _check_int(zp, ((n + 7) // 8, stored), zname)
                zp = _nibbles(zp.T.contiguous())[:, :n].T.float()              # stored as zp + 8
            else:
                zp = zp.float() + 8
            out.append(_per_group(zp, n, groups, zname, stored))
        return out + ([perm.to(torch.int32)] if scheme.act_order else [])


def _ct_match(module: str, target: str) -> bool:
    """compressed-tensors' name match: ``re:<regex>`` (``re.match``) or the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


# -- AutoAWQ ----------------------------------------------------------------------------------------
@dataclass
class _Awq(CheckpointQuantization):
    bits: int = 4
    group: int = 128
    skip: tuple = ()

    @classmethod
    def parse(cls, qc):
        where = "quantization_config"
        bits = _typed(qc, "bits", int, 4, where, alias="w_bit")
        group = _typed(qc, "group_size", int, 128, where, alias="q_group_size")
        version = str(qc.get("version") or qc.get("format") or "gemm").lower()     # transformers: format; legacy: version
        if version != "gemm" or str(qc.get("backend", "")).lower() == "llm-awq":
            raise GraphDSLError(f"quantization_config: AutoAWQ version/format {version!r} (backend "
                                f"{qc.get('backend')!r}) is not supported (only the GEMM layout)")
        if not _typed(qc, "zero_point", bool, True, where):
            raise GraphDSLError("quantization_config: AutoAWQ with zero_point=false is not supported")
        return cls(method="awq", leaves=_AWQ_LEAVES, bits=bits, group=group,
                   skip=tuple(qc.get("modules_to_not_convert") or ()))

    def describe(self, module):
        return f"awq gemm int{self.bits} g{self.group}"

    def _scheme(self, module, in_features):
        source = self.source_module(module)
        if module.split(".")[-1] == "lm_head" or any(s in source for s in self.skip):
            return None
        where = f"quantized linear {module + '.qweight'!r} ({self.describe(module)})"
        if self.bits != 4:
            raise GraphDSLError(f"{where}: {self.bits}-bit AWQ weights are not supported (4 bits)")
        return _int4_scheme(where, self.group, in_features, True)

    def _convert(self, module, scheme, got, n, k):
        where = f"quantized linear {module!r} ({self.describe(module)})"
        g = scheme.groups(k)
        qw = _check_int(got["qweight"], (k, n // 8), f"{where}: {module + '.qweight'!r}")
        qz = _check_int(got["qzeros"], (g, n // 8), f"{where}: {module + '.qzeros'!r}")
        s = _check_float(got["scales"], f"{where}: {module + '.scales'!r}")
        if tuple(s.shape) != (g, n):
            raise GraphDSLError(f"{where}: {module + '.scales'!r} should be [{g}, {n}], got {list(s.shape)}")
        codes = _awq_columns(qw).T.contiguous()          # [n, k]
        zeros = _awq_columns(qz).T.float()               # [n, g]
        return [pack_int4(codes), s.T.contiguous(), zeros]


def _awq_columns(t: torch.Tensor) -> torch.Tensor:
    """AWQ int32 ``[r, c]`` -> uint8 ``[r, 8c]`` in column order (undoing the ``_AWQ_ORDER`` interleave)."""
    nib = _nibbles(t).reshape(t.shape[0], t.shape[1], 8)
    out = torch.empty_like(nib)
    out[..., list(_AWQ_ORDER)] = nib
    return out.reshape(t.shape[0], -1)


# -- GPTQ -------------------------------------------------------------------------------------------
@dataclass
class _Gptq(CheckpointQuantization):
    bits: int = 4
    group: int = 128
    sym: bool = True
    v2: bool = False
    desc_act: bool = False
    lm_head: bool = False
    skip: tuple = ()

    @classmethod
    def parse(cls, qc):
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if qc.get("dynamic"):
            raise GraphDSLError(f"quantization_config: GPTQ per-module 'dynamic' overrides are not supported, got "
                                f"{qc['dynamic']!r}")
        if fmt not in ("gptq", "gptq_v2"):
            raise GraphDSLError(f"quantization_config: GPTQ checkpoint_format {fmt!r} is not supported "
                                "(gptq, gptq_v2)")
        where = "quantization_config"
        desc_act = _typed(qc, "desc_act", bool, False, where)
        # act-order groups are g_idx's: without it the codes' groups are unknown (no trivial default)
        return cls(method="gptq", leaves=_GPTQ_LEAVES, optional=() if desc_act else ("g_idx",),
                   bits=_typed(qc, "bits", int, 4, where), group=_typed(qc, "group_size", int, 128, where),
                   sym=_typed(qc, "sym", bool, True, where), v2=fmt == "gptq_v2",
                   desc_act=desc_act, lm_head=_typed(qc, "lm_head", bool, False, where),
                   skip=tuple(qc.get("modules_to_not_convert") or ()))

    def describe(self, module):
        return (f"gptq{'_v2' if self.v2 else ''} int{self.bits} g{self.group}{' sym' if self.sym else ''}"
                f"{' desc_act' if self.desc_act else ''}")

    def _scheme(self, module, in_features):
        source = self.source_module(module)
        if (module.split(".")[-1] == "lm_head" and not self.lm_head) or any(s in source for s in self.skip):
            return None
        where = f"quantized linear {module + '.qweight'!r} ({self.describe(module)})"
        if self.bits != 4:
            raise GraphDSLError(f"{where}: {self.bits}-bit GPTQ weights are not supported (4 bits)")
        scheme = _int4_scheme(where, None if self.group in (-1, None) else self.group, in_features, not self.sym)
        return replace(scheme, act_order=True) if self.desc_act else scheme

    def _convert(self, module, scheme, got, n, k):
        where = f"quantized linear {module!r} ({self.describe(module)})"
        g = scheme.groups(k)
        stored_g = 1 if self.group in (-1, None) else g
        qw = _check_int(got["qweight"], (k // 8, n), f"{where}: {module + '.qweight'!r}")
        qz = _check_int(got["qzeros"], (stored_g, n // 8), f"{where}: {module + '.qzeros'!r}")
        s = _check_float(got["scales"], f"{where}: {module + '.scales'!r}")
        if tuple(s.shape) != (stored_g, n):
            raise GraphDSLError(f"{where}: {module + '.scales'!r} should be [{stored_g}, {n}], got {list(s.shape)}")
        perm = _input_order(got.get("g_idx"), k, stored_g, f"{where}: {module + '.g_idx'!r}", scheme.act_order)
        codes = _nibbles(qw.T.contiguous()).contiguous()             # [n, k]: word r's nibble i is input 8r + i
        if scheme.act_order:                                          # each group's inputs side by side
            codes = codes[:, perm].contiguous()
        zeros = _nibbles(qz).T.float() + (0.0 if self.v2 else 1.0)    # [n, stored_g]
        scale = _per_group(s.T, n, g, f"{where}: {module + '.scales'!r}", stored_g)
        zeros = _per_group(zeros, n, g, f"{where}: {module + '.qzeros'!r}", stored_g)
        order = [perm.to(torch.int32)] if scheme.act_order else []
        if not scheme.zero_point:
            if not _meta(zeros) and not bool((zeros == 8).all()):
                raise GraphDSLError(f"{where}: {module + '.qzeros'!r} holds zero points other than 8 although "
                                    "sym=true (layout mismatch)")
            return [pack_int4(codes), scale] + order
        return [pack_int4(codes), scale, zeros] + order


def _input_order(g_idx, k: int, groups: int, what: str, act_order: bool) -> torch.Tensor:
    """The inputs in group order (``argsort(g_idx)``, stable): group ``j`` holds the inputs with
    ``g_idx == j``, ``k / groups`` of them. Without act order, ``g_idx`` (when stored) must be the
    trivial ``k // group_size``."""
    size = k // groups
    if g_idx is None:
        return torch.arange(k)
    gi = g_idx.reshape(-1).long()
    if gi.shape[0] != k:
        raise GraphDSLError(f"{what} should have {k} entries (one group per input), got {gi.shape[0]}")
    if _meta(gi):
        return torch.arange(k, device=gi.device)
    if not act_order:
        if not torch.equal(gi, torch.arange(k) // size):
            raise GraphDSLError(f"{what} is not the trivial k // group_size although the config asks no act order "
                                "(GPTQ desc_act / compressed-tensors actorder 'group')")
        return torch.arange(k)
    if int(gi.min()) < 0 or int(gi.max()) >= groups or not bool((torch.bincount(gi, minlength=groups) == size).all()):
        raise GraphDSLError(f"{what} must give each of the {groups} groups {size} inputs (act-order), got group "
                            f"sizes {torch.bincount(gi.clamp(min=0)).tolist()[:8]}...")
    return torch.argsort(gi, stable=True)
