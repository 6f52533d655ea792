"""CPU expert offload: an injected replacement of :class:`~graphdsl.layers.FusedExperts` whose routed
experts run on the host (multi-threaded torch, bf16 or fp32) while the rest of the model runs on the
GPU. Rule::

    - match: {name: "^model\\.layers\\.\\d+\\.mlp\\.experts$"}
      replace:
        class: graphdsl.models.cpu_experts.CPUExperts
        kwargs: {generate_device: cpu}
      recursive: false

Per step only the activations cross the bus: ``x [T, H]`` and each token's ``top_k`` expert ids
and weights go to the host, ``y [T, H]`` comes back; the expert weights stay in host memory (the
loader puts them there: :attr:`CPUExperts.weight_device`). The math is :func:`graphdsl.functional.moe_experts`'s::

    y[t] = Σ_{e in topk(t)} routing[t, e] · down_e · act(gate_e · x[t]) ⊙ (up_e · x[t])

computed per expert over the tokens routed to it (gather, two GEMMs, scatter-add in float32).
The op synchronises with the host, so models using it run decode without CUDA graphs.

Under ``quantization="int8"`` or ``"int4"`` (online, or a pre-quantized checkpoint in those schemes)
the host holds the stacks' codes, a half or a quarter of the memory, and multiplies bf16/fp16
activations through torch's CPU weight-only kernels (``torch._weight_int8pack_mm``,
``torch._weight_int4pack_mm_for_cpu``: ``W = (q - 8) · s + z`` per group, so a stored zero point ``zp``
becomes ``z = (8 - zp) · s``); float32 activations multiply each chosen expert's dequantized weights.
"""
from __future__ import annotations

import itertools
import weakref

import torch

from graphdsl import OpCategory, register_op, same_as
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError
from graphdsl.opdef import get_op
from graphdsl.layers import FusedExperts
from graphdsl.quant import IntScheme, QuantScheme

from .injection import Placement

__all__ = ["CPUExperts", "cpu_moe_experts"]

_STORES: "weakref.WeakValueDictionary[str, CPUExperts]" = weakref.WeakValueDictionary()
_IDS = itertools.count()
_OPS = ("torch",)


def _reference(x, routing, *, store: str, act=F.ActType.SWIGLU, top_k=None):
    """``moe_experts(x, routing, gate_up, down)`` with the stacked weights held on the host by the
    :class:`CPUExperts` registered as ``store``; the result is on ``x``'s device, in its dtype."""
    module = _STORES.get(store)
    if module is None or module.host_weights is None:
        raise GraphDSLError(f"cpu_moe_experts: no bound CPUExperts weights for store {store!r}; "
                            "bind the model's weights (FlashCausalLM.bind) before running")
    return module.run(x, routing, act, top_k)


_OP = dict(category=OpCategory.CUSTOM, shape=same_as(0))
_record = register_op("cpu_moe_experts", **_OP)(_reference)


def cpu_moe_experts(x, routing, *, store: str, act=F.ActType.SWIGLU, top_k=None):
    """Record the ``cpu_moe_experts`` op (registering it again if a registry reset dropped it)."""
    try:
        get_op("cpu_moe_experts")
    except GraphDSLError:
        register_op("cpu_moe_experts", **_OP)(_reference)
    return _record(x, routing, store=store, act=act, top_k=top_k)


class CPUExperts(FusedExperts):
    """Routed experts on the CPU; same Parameters and checkpoint slots as the module it replaces.
    Follows the :class:`~graphdsl.models.injection.InjectedModule` constructor protocol.

    Args (rule kwargs):
        generate_device / device: must be ``cpu`` (where the experts run and their weights live).
        prefill_device: ``cpu`` too (prefill on the GPU would need a second copy of the weights).
        out_device: accepted for the seed's rules; the result returns to the input's device.
        generate_op, prefill_op: ``torch`` (the only CPU kernel here).
        threads: ``torch.set_num_threads`` for the host GEMMs (None: torch's default).
    """

    cuda_graph_safe = False
    weight_device = "cpu"
    runs_schemes = "int8-channel and int4-g{32,64,128}[-zp] stacks"

    def takes_scheme(self, scheme: QuantScheme) -> bool:
        """int8 and int4 stacks (torch has CPU kernels for them); fp8 stays in the model dtype."""
        return isinstance(scheme, IntScheme) and scheme.stackable

    def __init__(self, key: str, config, orig_module, *, device: str | None = None, generate_device: str | None = None,
                 prefill_device: str | None = None, out_device: str | None = None, generate_op: str = "torch",
                 prefill_op: str = "torch", threads: int | None = None):
        if not isinstance(orig_module, FusedExperts):
            raise GraphDSLError(f"CPUExperts replaces FusedExperts modules, got {type(orig_module).__name__} at '{key}'")
        m = orig_module
        FusedExperts.__init__(self, m.num_experts, m.hidden_size, m.intermediate_size, m.act, m.gate_up_proj.dtype,
                              m.sources, m.top_k)
        place = Placement.from_kwargs({k: v for k, v in dict(device=device, generate_device=generate_device,
                                                             prefill_device=prefill_device).items() if v is not None})
        for name, dev in (("generate_device", place and place.generate), ("prefill_device", place and place.prefill)):
            if dev is not None and torch.device(dev).type != "cpu":
                raise GraphDSLError(f"CPUExperts: {name} must be 'cpu', got {dev!r}")
        for name, op in (("generate_op", generate_op), ("prefill_op", prefill_op)):
            if op not in _OPS:
                raise GraphDSLError(f"CPUExperts: {name} must be one of {list(_OPS)}, got {op!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise GraphDSLError(f"CPUExperts: threads must be a positive int or None, got {threads!r}")
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "threads", threads)
        object.__setattr__(self, "store_key", f"{key}#{next(_IDS)}")
        object.__setattr__(self, "host_weights", None)
        _STORES[self.store_key] = self

    def forward(self, x, routing):
        return cpu_moe_experts(x, routing, store=self.store_key, act=self.act, top_k=self.top_k)

    def bind_weights(self, weights: dict, path: str) -> None:
        """Take this module's stacked weights (``{path}.gate_up_proj``, ``{path}.down_proj``, or a
        quantized stack's companions) from the bound weights, on the host."""
        stacks = []
        for p in (self.gate_up_proj, self.down_proj):
            names = [c.name for c in p.companions()] if p.quant is not None else [p.name]
            stacks.append(HostStack(p.quant, [weights[n].to("cpu") for n in names], tuple(p.shape[1:])))
        object.__setattr__(self, "host_weights", tuple(stacks))

    def run(self, x: torch.Tensor, routing: torch.Tensor, act, top_k) -> torch.Tensor:
        """The op's body: route on ``x``'s device, compute on the host, return on ``x``'s device."""
        gate_up, down = self.host_weights
        k = top_k or routing.shape[-1]
        w, ids = routing.float().topk(k, dim=-1)                              # [T, k]
        xh, w, ids = x.to("cpu"), w.to("cpu"), ids.to("cpu")
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        out = torch.zeros(xh.shape, dtype=torch.float32)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=gate_up.experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tok = sel // k
            h = xh[tok].to(gate_up.dtype)
            gate, up = gate_up.mm(e, h).chunk(2, dim=-1)
            a = torch.nn.functional.silu(gate) if act is F.ActType.SWIGLU else \
                torch.nn.functional.gelu(gate, approximate="tanh")
            y = down.mm(e, (a * up).to(down.dtype))
            out.index_add_(0, tok, y.float() * w.reshape(-1)[sel].unsqueeze(-1))
        return out.to(dtype=x.dtype).to(x.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", device=cpu"


class HostStack:
    """One expert stack on the host and ``mm(e, h) = h @ W_eᵀ`` for expert ``e``: the weights
    themselves (``scheme`` None), or int8 / int4 codes (:class:`~graphdsl.quant.IntScheme` stacks)
    through torch's CPU weight-only kernels when ``h`` is bf16 or fp16, else (float32) each call's
    expert dequantized by the scheme (exact to the op's reference)."""

    def __init__(self, scheme: IntScheme | None, tensors: list[torch.Tensor], shape: tuple[int, int]):
        self.scheme, self.tensors, (self.rows, self.inputs) = scheme, tensors, shape
        self.experts = tensors[0].shape[0]
        self.dtype = tensors[0].dtype if scheme is None else tensors[1].dtype      # the scales': the model's
        self.kernel = None
        if scheme is not None and self.dtype in (torch.bfloat16, torch.float16):
            self.kernel = self._int8() if scheme.bits == 8 else self._int4()
            if self.kernel is not None and scheme.bits == 4:
                self.tensors = []          # the kernel's tiles hold the codes: keep one copy

    def _int8(self) -> tuple:
        codes, scales = self.tensors
        return codes, scales.reshape(self.experts, self.rows)

    def _int4(self) -> tuple | None:
        """Per expert, the codes in the CPU int4 kernel's tiles and its ``[groups, rows, 2]``
        (scale, zero) in the activations' dtype; None when the kernel cannot take the shape."""
        from graphdsl.quant import unpack_int4
        codes, scales = self.tensors[:2]
        zp = self.tensors[2].float() if self.scheme.zero_point else 8.0
        packed, sz = [], []
        try:
            for e in range(self.experts):
                q = unpack_int4(codes[e]).to(torch.int32)
                packed.append(torch._convert_weight_to_int4pack_for_cpu(q, 2))
                s = scales[e].float()
                z = (8.0 - (zp[e] if self.scheme.zero_point else zp)) * s
                sz.append(torch.stack([s.T, z.T], -1).to(self.dtype).contiguous())
        except RuntimeError:           # a shape the packed layout does not take: dequantize per call
            return None
        return packed, sz

    def nbytes(self) -> int:
        """Host bytes the stack holds."""
        held = list(self.tensors) + [t for part in (self.kernel or ()) for t in
                                     (part if isinstance(part, list) else [part])]
        return sum({t.data_ptr(): t.numel() * t.element_size() for t in held}.values())

    def mm(self, e: int, h: torch.Tensor) -> torch.Tensor:
        if self.scheme is None:
            return h @ self.tensors[0][e].mT
        if self.kernel is not None:
            x = h.to(self.dtype)
            if self.scheme.bits == 8:
                codes, scales = self.kernel
                return torch._weight_int8pack_mm(x, codes[e], scales[e]).to(h.dtype)
            packed, sz = self.kernel
            return torch._weight_int4pack_mm_for_cpu(x, packed[e], self.scheme.group_size, sz[e]).to(h.dtype)
        w = self.scheme.dequantize([t[e] for t in self.tensors], self.rows, self.inputs, torch.float32)
        return (h.float() @ w.T).to(h.dtype)
