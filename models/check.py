"""``check_model(path)``: what of a checkpoint graphdsl supports, without running it.

Reads ``config.json`` (or GGUF metadata) and the tensor headers, then reports every problem at
once: an unknown architecture (with the supported list), config fields graphdsl does not implement
(unsupported rope types, activations, quantization formats), and weights the model would not find.
A pre-quantized checkpoint's stored tensors are matched by name as the loader converts them
(:meth:`~graphdsl.runtime.loaders.prequantized.CheckpointQuantization.check_names`), then run
through the loader's conversion as headers (meta tensors: shapes and dtypes, not values).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.loaders.checkpoint import CheckpointFormat, checkpoint_format, has_tokenizer
from graphdsl.runtime.loaders.prequantized import read_checkpoint_quantization

from .config import ModelConfig, build_config, read_hf_config
from .gguf_weights import keep_gguf_blocks
from .loader import mark_checkpoint_quantization, online_quantization, wants_gguf_blocks
from .registry import load_custom_module_map, resolve_model_class

__all__ = ["ModelCheck", "check_model"]


@dataclass
class ModelCheck:
    """The result: ``ok`` when nothing is unsupported; ``str()`` is a readable report."""

    path: str
    model_type: str | None = None
    architectures: list[str] = field(default_factory=list)
    model_class: str | None = None
    config: ModelConfig | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)     # what works differently, though supported

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = (f"{self.path}: model_type={self.model_type!r} architectures={self.architectures} "
                f"-> {self.model_class or 'no model class'}")
        lines = ["  supported"] if self.ok else [f"  unsupported: {p}" for p in self.problems]
        return "\n".join([head, *lines, *(f"  note: {n}" for n in self.notes)])


def check_model(path: str | os.PathLike, custom_module_map: str | os.PathLike | None = None,
                optimize_rules=None, quantization=None) -> ModelCheck:
    """Check a HF model directory or a ``.gguf`` file; returns a :class:`ModelCheck` (never raises
    for an unsupported model, only for an unreadable path). ``optimize_rules`` are applied to the
    module tree first, so the weights are checked against the injected modules. ``quantization``
    (as ``LLM`` takes it) also checks that the scheme holds every linear weight, and notes the
    schemes they would load in."""
    path = os.fspath(path)
    if custom_module_map is not None:
        load_custom_module_map(custom_module_map)
    gguf = checkpoint_format(path) is CheckpointFormat.GGUF
    if gguf:
        from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
        ckpt = GGUFCheckpoint(path)
        try:
            hf = ckpt.hf_config()
        except GraphDSLError as e:
            return ModelCheck(path, problems=[str(e)])
    else:
        hf = read_hf_config(path)
    report = ModelCheck(path, hf.get("model_type"), list(hf.get("architectures") or []))
    _check_tokenizer(report, ckpt if gguf else None)
    try:
        stored = None if gguf else read_checkpoint_quantization(hf)
    except GraphDSLError as e:
        report.problems.append(str(e))
        stored = None
    try:
        cls = resolve_model_class(hf.get("model_type"), hf.get("architectures") or ())
        report.model_class = cls.__name__
    except GraphDSLError as e:
        report.problems.append(str(e))
        return report
    try:
        report.config = build_config(hf)
    except GraphDSLError as e:
        report.problems.append(str(e))
        return report
    model = cls(report.config)
    if optimize_rules is not None:
        from .injection import apply_rules
        try:
            apply_rules(model, optimize_rules, report.config)
        except GraphDSLError as e:
            report.problems.append(str(e))
            return report
    expected = {n: s.shape for n, s in model.checkpoint_table().items()}
    headers = {} if gguf else _safetensors_headers(path)
    got = ckpt.hf_shapes() if gguf else {n: shape for n, (shape, _) in headers.items()}
    got = {model.checkpoint_name(n): s for n, s in got.items()}
    got = {n: s for n, s in got.items() if not model.is_ignored_checkpoint_name(n)}
    if stored is not None:
        try:
            quantized = mark_checkpoint_quantization(model, stored, headers)
        except GraphDSLError as e:
            report.problems.append(str(e))
            return report
        got, problems = stored.check_names(got)
        if not problems:
            problems = _convert_headers(stored, headers, model)
        report.problems.extend(problems)
        if not problems:
            schemes = sorted({p.quant.name for n, p in model.named_parameters() if n in quantized})
            report.notes.append(f"pre-quantized ({stored.method}): {len(quantized)} linear weights load in "
                                f"{', '.join(schemes) or 'no scheme'} (stored values such as g_idx are checked "
                                "when they load)")
    from graphdsl.runtime.loaders.safetensors import WeightReport
    weights = WeightReport.compare(expected, got)
    if not weights.ok:
        report.problems.append("weights:\n    " + str(weights).replace("\n", "\n    "))
    if quantization is not None:
        _check_online_quantization(report, model, quantization, stored, ckpt if gguf else None)
    return report


def _check_online_quantization(report: ModelCheck, model, quantization, stored, gguf_ckpt) -> None:
    """What ``LLM(..., quantization=)`` would refuse, as problems; the schemes it would store, as a note
    (``quantization='gguf'``: the file's blocks each weight keeps, by the loader's own rule; the
    weights it dequantizes and why are logged as when loading)."""
    from graphdsl.layers.quantize import dense_expert_share, quantize_linears, scheme_counts
    try:
        if online_quantization(quantization, stored) is None:      # the checkpoint's own format, named
            report.notes.append(f"quantization={quantization!r}: the checkpoint's own format; it loads as stored")
            return
        if wants_gguf_blocks(quantization, None if gguf_ckpt is not None else report.path):
            kept = keep_gguf_blocks(model, gguf_ckpt.block_types())
            dense, _ = dense_expert_share(model)
            keeps = (f"{len(kept)} weights keep the file's blocks ({scheme_counts(model)})" if kept else
                     "no weight keeps the file's blocks (the log names each and why)")
            report.notes.append(f"quantization='gguf': {keeps}"
                                + (f"; {dense} MoE expert stacks are dequantized" if dense else ""))
            return
        quantize_linears(model, quantization)
    except GraphDSLError as e:
        report.problems.append(str(e))
        return
    dense, _ = dense_expert_share(model)
    report.notes.append(f"quantization={quantization!r}: the linear weights load in {scheme_counts(model) or 'no scheme'}"
                        + (f"; {dense} MoE expert stacks stay in the model dtype" if dense else ""))


def _check_tokenizer(report: ModelCheck, gguf_ckpt) -> None:
    """A GGUF file's tokenizer must build (LLM needs it); a HF directory may lack one, which limits
    it to token-id prompts (the CLI cannot run it), and a present one must load."""
    from graphdsl.runtime.loaders.tokenizer import Tokenizer
    if gguf_ckpt is None and not has_tokenizer(report.path, CheckpointFormat.HF_DIR):
        report.notes.append("no tokenizer.json: LLM.generate and LLM.score take token ids only; "
                            "the graphdsl generate and chat commands need one")
        return
    try:
        gguf_ckpt.tokenizer() if gguf_ckpt is not None else Tokenizer.from_pretrained(report.path)
    except GraphDSLError as e:
        report.problems.append(f"tokenizer: {e}")


def _convert_headers(stored, headers: dict, model) -> list[str]:
    """The loader's conversion of a pre-quantized checkpoint run over its tensor headers (meta
    tensors: shapes and dtypes, no values), so a stored tensor of the wrong shape or dtype is found
    without reading it; a check that needs the values (g_idx, weight_shape) stops it quietly."""
    import torch
    meta = ((n, torch.empty(shape, dtype=dtype, device="meta")) for n, (shape, dtype) in headers.items()
            if dtype is not None)
    try:
        for _ in stored.convert(meta, torch.float32, model.checkpoint_name):
            pass
    except GraphDSLError as e:
        return [str(e)]
    except (NotImplementedError, RuntimeError):       # a meta tensor asked for its values
        pass
    return []


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _safetensors_headers(path: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """``{name: (shape, torch dtype or None when torch has none)}`` of every tensor, from the headers."""
    import torch
    from safetensors import safe_open

    from graphdsl.runtime.loaders.safetensors import safetensors_files
    headers = {}
    for file, names in safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in names or f.keys():
                    sl = f.get_slice(name)
                    dtype = getattr(torch, _SAFETENSORS_DTYPES.get(sl.get_dtype(), ""), None)
                    headers[name] = (tuple(sl.get_shape()), dtype)
        except GraphDSLError:
            raise
        except Exception as e:
            raise GraphDSLError(f"{file!r} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
    return headers
