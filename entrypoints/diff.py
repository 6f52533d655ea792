"""``graphdsl diff MODEL``: one prompt through graphdsl and HF transformers, compared module by module.

How it works:

1. HF transformers runs the prompt (float32, eager attention) with a forward hook on every module,
   keeping each module's first output;
2. graphdsl runs the same prefill twice: the model's real engine (fused, its backend) for the
   logits, and the *recorded* graph built with no passes (``passes=[]``, torch backend), tapping
   every op (:mod:`graphdsl.runtime.taps`), so every recorded op has a value;
3. tensors are aligned by module path: recording keeps each module call's returned tensors
   (``Network.module_io``), and our modules carry HF's names. Where the two frameworks return
   different things from a module of the same name, a fixed convention applies: a decoder layer
   (``...layers.N``/``...h.N``) returns ``(delta, residual)`` whose sum is HF's layer output; a norm
   taking a residual returns ``(normed, new residual)``, HF's output being the first; a packed
   projection (``qkv_proj``, ``gate_up_proj``) is compared with its HF parts (``q_proj``, ...,
   from the layer's ``sources``) concatenated. HF module names go through the model's
   ``checkpoint_renames`` first (Bloom's ``transformer.h.3`` is our ``model.layers.3``). Shapes that
   still differ are skipped, and so is a module whose tensor matches HF under another module name
   but not under this one (HF defines its output differently: Bloom's ``mlp`` adds the residual);
4. per aligned module: ``max_rel = max|ours - hf| / max|hf|``, ``mean_rel = mean|ours - hf| /
   mean|hf|`` and the cosine similarity, rows in the order our graph computes them;
5. a kernel check: the real engine's tapped tensors against the unfused graph's of the same name,
   in launch order; the first that differs names the fused kernels run since the last that matched
   (where a wrong kernel or fusion shows when the unfused graph still matches HF);
6. the first row whose ``max_rel`` exceeds ``tolerance`` is the divergence. Its ops are the
   recorded ops between the aligned tensors that still matched and that tensor (the ancestors of
   the divergent tensor, stopping at matched tensors and graph inputs); the first arithmetic op
   among them (views and pure data movement after) is named, with its source line, module, and the fused kernel of the real
   engine that computes it (:func:`graphdsl.runtime.taps.kernel_for`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.layers import Phase
from graphdsl.opdef import OpCategory
from graphdsl.runtime.taps import kernel_for

from .steps import prefill_feed

__all__ = ["DiffRow", "Divergence", "DiffReport", "diff_model", "compare"]

_LAYER = re.compile(r"(^|\.)(layers|h)\.\d+$")


@dataclass
class DiffRow:
    """One aligned tensor: our recorded tensor(s) vs HF's module output."""

    module: str
    tensors: tuple[str, ...]
    shape: tuple[int, ...]
    max_rel: float
    mean_rel: float
    cosine: float
    ok: bool
    order: int = 0                     # our graph's step that completes the tensor


@dataclass
class Divergence:
    """Where the error first exceeds the tolerance."""

    row: DiffRow
    node: str                          # the recorded op named as the culprit
    op: str
    module: str
    source: str
    kernel: str                        # the real engine's node computing it ("name (op)") or "-"
    between: list[str] = field(default_factory=list)   # every recorded compute op in the suspect region

    def __str__(self) -> str:
        return (f"first divergence: op '{self.node}' ({self.op}) at {self.source}, module {self.module or '-'}; "
                f"computed by kernel {self.kernel}; aligned tensor {'+'.join(self.row.tensors)} of module "
                f"{self.row.module}: max rel {self.row.max_rel:.3g} > tolerance"
                + (f"\n  suspect ops (in order): {', '.join(self.between)}" if len(self.between) > 1 else ""))


@dataclass
class KernelMismatch:
    """The real (fused) engine's first tensor that differs from the same tensor of the unfused graph."""

    tensor: str
    max_rel: float
    kernels: list[str]                 # "name (op) at source": the kernels since the last tensor that matched

    def __str__(self) -> str:
        return (f"kernel check: the real engine's '{self.tensor}' differs from the unfused graph's (max rel "
                f"{self.max_rel:.3g}); computed by {', then '.join(self.kernels)}")


def _kernel_check(engine, values: dict, fused: dict, tolerance: float) -> KernelMismatch | None:
    """Walk the real engine's launches in order; the first output both graphs name whose values differ
    names the kernels run since the last output that matched. A fused kernel's new output counts as
    matching when it equals one of the recorded tensors of its shape that the kernel stands for
    (:func:`~graphdsl.runtime.taps.kernel_for`): ``add_rms_norm``'s two outputs are the recorded
    ``add`` and ``rms_norm``."""
    rec = engine.recorded
    stands_for: dict = {}
    for n in rec.nodes:
        k = kernel_for(engine.net, rec, n.name)
        if k is not None:
            stands_for.setdefault(k, []).extend(t.name for t in n.outputs)
    since: list[str] = []
    for node in engine._run_nodes:
        if node.category is not OpCategory.VIEW:
            since.append(f"'{node.name}' ({node.op}) at {_short_source(node.source)}")
        for t in node.outputs:
            got, ref = fused.get(t.name), values.get(t.name)
            if got is None:
                continue
            if ref is None:                      # a fused kernel's own output: certified by a match only
                same = [values[r] for r in stands_for.get(node, ()) if r in values and values[r].shape == got.shape]
                if any(compare(got, r)[0] <= tolerance for r in same):
                    since = []
                continue
            if ref.shape != got.shape:
                continue
            max_rel = compare(got, ref)[0]
            if max_rel > tolerance:
                return KernelMismatch(t.name, max_rel, since)
            since = []
    return None


@dataclass
class DiffReport:
    rows: list[DiffRow]
    tolerance: float
    first: Divergence | None
    logits: DiffRow | None = None      # the real (fused) engine's logits vs HF's
    skipped: list[str] = field(default_factory=list)   # HF modules our graph names but no tensor aligns with
    kernel: KernelMismatch | None = None   # the real engine's first tensor that differs from the unfused graph

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and (self.logits is None or self.logits.ok) and self.kernel is None

    def table(self) -> str:
        w = max([len(r.module) for r in self.rows] + [6])
        lines = [f"{'module':<{w}}  {'tensor':<24} {'max rel':>9} {'mean rel':>9} {'cosine':>9}"]
        for r in self.rows:
            mark = "" if r.ok else "  <-- over tolerance"
            lines.append(f"{r.module:<{w}}  {'+'.join(r.tensors)[:24]:<24} {r.max_rel:9.2e} {r.mean_rel:9.2e} "
                         f"{r.cosine:9.6f}{mark}")
        if self.logits is not None:
            r = self.logits
            lines.append(f"{'logits (engine)':<{w}}  {'+'.join(r.tensors)[:24]:<24} {r.max_rel:9.2e} "
                         f"{r.mean_rel:9.2e} {r.cosine:9.6f}" + ("" if r.ok else "  <-- over tolerance"))
        return "\n".join(lines)

    def __str__(self) -> str:
        tail = str(self.first) if self.first is not None else \
            f"no divergence: every aligned tensor within max rel {self.tolerance:g}"
        if self.kernel is not None:
            tail += f"\n{self.kernel}"
        elif self.first is None and self.logits is not None and not self.logits.ok:
            tail = (f"the unfused graph matches HF, but the real engine's logits do not (max rel "
                    f"{self.logits.max_rel:.3g}) while no tensor both graphs name differs")
        return f"{self.table()}\n{len(self.rows)} aligned tensors, tolerance {self.tolerance:g}\n{tail}"


def compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """``(max_rel, mean_rel, cosine)`` of ``ours`` against ``ref`` (float64, flattened)."""
    a, b = ours.detach().double().flatten().cpu(), ref.detach().double().flatten().cpu()
    d = (a - b).abs()
    max_rel = (d.max() / b.abs().max().clamp_min(1e-30)).item() if d.numel() else 0.0
    mean_rel = (d.mean() / b.abs().mean().clamp_min(1e-30)).item() if d.numel() else 0.0
    denom = (a.norm() * b.norm()).item()
    cosine = (a @ b).item() / denom if denom > 0 else (1.0 if a.abs().max() == b.abs().max() == 0 else 0.0)
    if math.isnan(max_rel):
        max_rel = mean_rel = math.inf
    return max_rel, mean_rel, cosine


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    if hasattr(value, "to_tuple"):          # transformers ModelOutput
        return _first_tensor(value.to_tuple())
    return None


def hf_module_outputs(hf_model, ids: list[int]) -> dict[str, torch.Tensor]:
    """Run ``hf_model`` on ``ids``; ``{module name: its first call's first output tensor}``."""
    outs: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name):
        def fn(_mod, _args, out):
            t = _first_tensor(out)
            if t is not None and name not in outs:
                outs[name] = t.detach().clone()
        return fn

    for name, mod in hf_model.named_modules():
        if name:
            handles.append(mod.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits
    finally:
        for h in handles:
            h.remove()
    outs["<logits>"] = logits[0].float()
    return outs


def _our_name(model, hf_name: str) -> str:
    """A HF module name in our naming: the model's checkpoint renames applied to ``NAME.weight``."""
    if hf_name.startswith("<"):
        return hf_name
    mapped = model.checkpoint_name(hf_name + ".weight")
    return mapped[:-len(".weight")] if mapped.endswith(".weight") else hf_name


def _align(model, rec, hf: dict[str, torch.Tensor], values: dict[str, torch.Tensor]):
    """``[(module, our tensors, our value, hf value)]`` for every module both sides name, and the
    names of modules that could not be aligned."""
    pairs, skipped = [], []
    for path, (_ins, outs) in rec.module_io.items():
        if not outs or any(t.name not in values for t in outs):
            continue
        try:
            mod = model.get_submodule(path)
        except GraphDSLError:
            mod = None
        parent = path.rpartition(".")[0]
        sources = tuple(getattr(mod, "sources", ()) or ())
        if sources and all(f"{parent}.{s}" in hf for s in sources):
            parts = [hf[f"{parent}.{s}"] for s in sources]
            if len(outs) == len(sources):      # q, k, v returned apart
                for t, s, ref in zip(outs, sources, parts):
                    pairs.append((f"{parent}.{s}", (t.name,), values[t.name], ref))
                continue
            ref = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts], dim=-1)
            pairs.append((path, (outs[0].name,), values[outs[0].name], ref))
            continue
        if path not in hf:
            continue
        ref = hf[path]
        if _LAYER.search(path) and len(outs) == 2:
            ours, names = values[outs[0].name] + values[outs[1].name], (outs[0].name, outs[1].name)
        else:
            ours, names = values[outs[0].name], (outs[0].name,)
        if ours.numel() != ref.numel():
            skipped.append(path)
            continue
        pairs.append((path, names, ours, ref))
    return pairs, skipped


def _culprit(rec, bad: DiffRow, good: set[str]) -> list:
    """Recorded compute ops between matched tensors (and graph inputs) and the divergent tensor."""
    producer = {t.name: n for n in rec.nodes for t in n.outputs}
    seen, stack, found = set(), list(bad.tensors), set()
    while stack:
        name = stack.pop()
        if name in seen or name in good:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            continue
        found.add(node)
        stack.extend(t.name for t in node.inputs)
    order = {n: i for i, n in enumerate(rec.nodes)}
    ops = sorted((n for n in found if n.category is not OpCategory.VIEW), key=order.__getitem__)
    compute = [n for n in ops if n.category is not OpCategory.DATA_MOVEMENT]
    return compute + [n for n in ops if n not in compute]   # arithmetic first: copies rarely change values


def _short_source(source: str) -> str:
    """``layers/mlp.py:25`` for a line of graphdsl's own rooms, wherever it is installed."""
    import os

    import graphdsl.layers
    root = os.path.dirname(os.path.dirname(os.path.abspath(graphdsl.layers.__file__))) + os.sep
    return source[len(root):] if source.startswith(root) else source


def diff_model(model, prompt: str | None = None, *, token_ids: list[int] | None = None, tolerance: float = 1e-3,
               reference=None, llm=None, hf_model=None) -> DiffReport:
    """Compare graphdsl with HF transformers on one prompt (see the module docstring).

    Args:
        model: what graphdsl runs: a HF model directory or a GGUF file (quantized weights).
        reference: the HF model directory transformers loads as the reference (default: ``model``;
            needed for a GGUF ``model``: e.g. the full-precision checkpoint it was quantized from, so
            each row shows what quantization costs that module).
        prompt / token_ids: what to run (token ids win; default: the prompt ``"The quick brown fox"``
            through the tokenizer, else ids ``1..8``).
        tolerance: the ``max_rel`` above which an aligned tensor counts as divergent.
        llm, hf_model: already loaded models to use instead (float32 on CPU is what the defaults load).
    """
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance > 0:
        raise GraphDSLError(f"diff: tolerance must be a positive number, got {tolerance!r}")
    if llm is None:
        from .llm import LLM
        llm = LLM(model, device="cpu", dtype=torch.float32, cuda_graphs=False)
    if hf_model is None:
        import transformers
        from graphdsl.runtime.loaders.checkpoint import CheckpointFormat, checkpoint_format
        reference = reference or model
        if checkpoint_format(reference) is not CheckpointFormat.HF_DIR:
            raise GraphDSLError(f"diff: reference must be a HF model directory for transformers to load, got "
                                f"{str(reference)!r} (for a GGUF model pass reference=<the HF checkpoint>)")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            reference, dtype=torch.float32, attn_implementation="eager").eval()
    if token_ids is None:
        tok = llm.tokenizer
        token_ids = tok.encode(prompt or "The quick brown fox") if tok is not None else list(range(1, 9))
    ids = [int(i) for i in token_ids]
    if not ids:
        raise GraphDSLError("diff: token_ids must not be empty")
    hf = hf_module_outputs(hf_model, ids)

    engine = llm.model.engine(Phase.PREFILL)
    rec = engine.recorded
    unfused = rec.build_engine(passes=[], backend="torch", device=llm.device, cache=False)
    unfused.set_weights({k: v for k, v in llm.model._bound.items() if k in unfused.net.inputs})
    sid = ("diff", id(ids))
    try:
        unfused.forward(prefill_feed(llm, unfused, ids, sid), taps="op:*")
    finally:
        llm.blocks.free(sid)
    values = dict(unfused.tapped)
    try:
        ours_logits = engine.forward(prefill_feed(llm, engine, ids, sid), taps="op:*")["logits"]
    finally:
        llm.blocks.free(sid)
    kernel = _kernel_check(engine, values, dict(engine.tapped), tolerance)

    hf = {_our_name(llm.model, k): v for k, v in hf.items()}
    pairs, skipped = _align(llm.model, rec, hf, values)
    order = {t.name: i for i, n in enumerate(rec.nodes) for t in n.outputs}
    rows = []
    for path, names, ours, ref in pairs:
        max_rel, mean_rel, cos = compare(ours, ref)
        rows.append(DiffRow(path, names, tuple(ref.shape), max_rel, mean_rel, cos, max_rel <= tolerance,
                            max(order.get(n, -1) for n in names)))
    rows.sort(key=lambda r: (r.order, -r.module.count(".")))
    # a tensor that matches HF under one module name but not another: HF defines that other
    # module's output differently (Bloom's mlp adds the residual); not a divergence
    matched = {r.tensors for r in rows if r.ok}
    differ = [r for r in rows if not r.ok and r.tensors in matched]
    skipped += [r.module for r in differ]
    rows = [r for r in rows if r not in differ]
    first = None
    bad = next((r for r in rows if not r.ok), None)
    if bad is not None:
        # tensors certified one by one (a row comparing a sum certifies neither part)
        good = {r.tensors[0] for r in rows if r.ok and len(r.tensors) == 1 and r.order <= bad.order}
        ops = _culprit(rec, bad, good) or [n for n in rec.nodes if any(t.name in bad.tensors for t in n.outputs)]
        if ops:
            node = ops[0]
            k = kernel_for(engine.net, rec, node.name)
            first = Divergence(bad, node.name, node.op, node.module, _short_source(node.source),
                               f"'{k.name}' ({k.op})" if k is not None else "- (folded away)",
                               [f"{n.name} ({n.op})" for n in ops])
    logits = None
    if "<logits>" in hf:
        mr, me, cs = compare(ours_logits, hf["<logits>"])
        logits = DiffRow("logits", ("logits",), tuple(hf["<logits>"].shape), mr, me, cs, mr <= tolerance)
    return DiffReport(rows, float(tolerance), first, logits, skipped, kernel)
