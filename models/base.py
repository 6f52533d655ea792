"""``FlashCausalLM`` — the base of every model — and the ``to_engine`` decorator.

A model is a :class:`~graphdsl.Module` tree whose ``forward(ctx)`` returns logits (in the model's
dtype; :meth:`FlashCausalLM.execute` hands them out as float32): for the rows
``ctx.lm_head_indices`` in prefill, for every token in decode. ``@to_engine(*features)`` gives
the class its runtime entry point :meth:`FlashCausalLM.execute`: the first call per
``(phase, frozenset(features))`` records ``forward`` on fake tensors with symbolic dims
(``num_tokens``, ``num_seqs``, ``num_blocks``, ...), builds the engine with
``net.build_engine()``, binds weights and KV caches by name once, and caches it; every later
call only fills the step's inputs and runs ``engine.forward``. Shape specialisations are cached
inside the engine (one plan per shape signature).
"""
from __future__ import annotations

import gc
import re
import weakref
from typing import Iterable, Mapping

import torch

from graphdsl import Module, Network
from graphdsl import functional as F
from graphdsl.env import env_flag
from graphdsl.errors import GraphDSLError
from graphdsl.layers import CheckpointSlot, ForwardContext, KVCacheSpec, Phase, checkpoint_layout

from .config import ModelConfig

__all__ = ["FlashCausalLM", "to_engine", "decode_pads", "cuda_graphs_enabled"]


class FlashCausalLM(Module):
    """Base class: ``self.model`` (embedding → layers → norm, with ``rotary_emb``) and ``self.lm_head``.

    Subclasses build the tree in ``__init__(config, dtype)``; they may override
    :meth:`_update_model_inputs` to feed extra graph inputs, extend ``ignored_checkpoint_names``
    (regexes) for checkpoint tensors that carry no weights, and list ``checkpoint_renames``:
    ``(regex, replacement)`` pairs applied in order to every checkpoint tensor name before it is
    looked up (a family whose checkpoints name a module differently from the layers, e.g.
    Mixtral's ``block_sparse_moe.experts.{e}.w1`` for ``mlp.experts.{e}.gate_proj``).
    """

    model_types: tuple[str, ...] = ()
    ignored_checkpoint_names: tuple[str, ...] = (r"\.rotary_emb\.inv_freq$",)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    engine_features: frozenset | None = None     # set by @to_engine

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "dtype", dtype or config.dtype)
        object.__setattr__(self, "_engines", {})
        object.__setattr__(self, "_bound", {})
        object.__setattr__(self, "_cache_spec", None)
        object.__setattr__(self, "_runtime", {"backend": None, "cuda_graphs": True, "max_blocks_per_seq": None})
        object.__setattr__(self, "_graph_runners", {})     # decode engine id -> CudaGraphRunner
        object.__setattr__(self, "_prefill_runners", {})   # prefill engine id -> ShapeGraphRunner
        object.__setattr__(self, "_capturable", weakref.WeakKeyDictionary())   # engine -> graph_capturable()
        object.__setattr__(self, "_num_cache_blocks", 0)
        object.__setattr__(self, "_lora", None)

    # -- architecture ------------------------------------------------------------------------
    def forward(self, ctx: ForwardContext):
        """Logits in the model's dtype: :meth:`execute` returns them as float32 (an exact cast),
        while the decode graph's greedy argmax, the sampler and the logprobs read them as they are
        (as float32 inside their kernels) — at batch 256 of Llama-3.2-1B the float32 copy was 3%
        of a step."""
        hidden = self.model(ctx)
        if ctx.lm_head_indices is not None:
            hidden = F.gather(hidden, 0, ctx.lm_head_indices)
        return self.lm_head(hidden)

    @property
    def rotary(self):
        """The model's rotary embedding (``model.rotary_emb``); None for models without RoPE (ALiBi)."""
        return getattr(self.model, "rotary_emb", None)

    # -- checkpoint mapping ------------------------------------------------------------------
    def checkpoint_table(self) -> dict[str, CheckpointSlot]:
        """``{checkpoint tensor name: slot}``; the tied lm_head is filled from the embedding."""
        table = checkpoint_layout(self)
        if self.config.tie_word_embeddings:
            table.pop("lm_head.weight", None)
        return table

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this model's naming (``checkpoint_renames`` applied)."""
        for pattern, replacement in self.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        return name

    def is_ignored_checkpoint_name(self, name: str) -> bool:
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        return any(re.search(p, name) for p in self.ignored_checkpoint_names)

    def parameter_devices(self) -> dict[str, str]:
        """``{parameter: device}`` for parameters placed off the model's device (a quantized
        weight's companions with it): by an injected module's ``weight_device`` (e.g.
        :class:`~graphdsl.models.cpu_experts.CPUExperts` on the host), or by an optimize rule's
        placement of their module (``generate_device``, a ``transfer_map``)."""
        from .injection import placement_of
        out = {}
        for path, m in self.named_modules():
            dev = getattr(m, "weight_device", None)
            if dev is None and m._parameters:
                p = placement_of(self, path)
                dev = None if p is None else p.generate
            if dev is None:
                continue
            for leaf, p in m._parameters.items():
                out[f"{path}.{leaf}"] = dev
                if getattr(p, "quant", None) is not None:       # a quantized weight lives in its companions
                    out.update((c.name, dev) for c in p.companions())
        return out

    def layer_devices(self, home) -> list[str]:
        """The device of each decoder layer's attention, where its KV cache blocks live."""
        from .injection import normalize_device, placement_of
        out = []
        for i in range(self.config.num_hidden_layers):
            p = placement_of(self, f"model.layers.{i}.self_attn")
            out.append(normalize_device(p.generate) if p is not None and p.generate is not None
                       else normalize_device(home))
        return out

    def graph_capturable(self) -> bool:
        """False when some (injected) module sets ``cuda_graph_safe = False``: it runs
        host-synchronising ops, so decode runs without CUDA graphs."""
        return all(getattr(m, "cuda_graph_safe", True) for _, m in self.named_modules() if m is not self)

    def tied_parameters(self) -> dict[str, str]:
        """``{parameter: parameter it shares storage with}``."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    # -- runtime hooks -----------------------------------------------------------------------
    def _update_model_inputs(self, meta: Mapping[str, torch.Tensor]) -> tuple[dict, dict, dict]:
        """Extra ``(engine inputs, engine outputs, runtime params)`` for this step (default none)."""
        return {}, {}, {}

    def bind(self, weights: Mapping[str, torch.Tensor], kv_caches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             block_size: int, device=None) -> None:
        """Attach real weights and KV caches; engines built later bind them by name. ``device``: where
        a step's inputs arrive (default: the first cache's device); modules placed elsewhere by
        optimize rules run in engines of their own device (a partitioned engine)."""
        caches = list(kv_caches)
        if len(caches) != self.config.num_hidden_layers:
            raise GraphDSLError(f"bind: expected {self.config.num_hidden_layers} (key, value) cache pairs, "
                                f"got {len(caches)}")
        bound = dict(weights)
        for i, (k, v) in enumerate(caches):
            bound[KVCacheSpec.key_name(i)], bound[KVCacheSpec.value_name(i)] = k, v
        k0 = caches[0][0]
        spec = KVCacheSpec(len(caches), k0.shape[2], k0.shape[3], block_size, k0.dtype)
        for path, m in self.named_modules():
            hook = getattr(m, "bind_weights", None)
            if hook is not None:
                hook(bound, path)
        from graphdsl.layers import quantize
        quantize.store_codes_in_blocks(self, bound, quantize.BLOCK_DEVICES)    # CUDA: blocks
        object.__setattr__(self, "_bound", bound)
        from .injection import normalize_device
        object.__setattr__(self, "_home", torch.device(normalize_device(device)) if device is not None else k0.device)
        object.__setattr__(self, "_cache_spec", spec)
        object.__setattr__(self, "_num_cache_blocks", k0.shape[0])
        self._engines.clear()
        self._graph_runners.clear()
        self._prefill_runners.clear()

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph (the decode and prefill runners), once the device is done
        with them; later steps capture afresh. A graph that captured NCCL collectives holds a
        reference on the communicator that only the graph's destruction drops, and NCCL's teardown
        waits for it: tensor parallelism calls this before leaving its process group."""
        if not (self._graph_runners or self._prefill_runners):
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self._graph_runners.clear()
        self._prefill_runners.clear()
        gc.collect()                 # graphs in reference cycles go now, not at some later collection

    def configure_runtime(self, *, backend: str | None = None, cuda_graphs: bool = True,
                          max_blocks_per_seq: int | None = None) -> None:
        """How engines are built and run (drops engines already built).

        Args:
            backend: the engines' backend (default: ``triton`` on CUDA, ``torch`` on CPU).
            cuda_graphs: replay decode steps through CUDA graphs per batch bucket on CUDA (also off
                with ``GRAPHDSL_CUDA_GRAPHS=0``), and prefill steps (off alone with
                ``GRAPHDSL_PREFILL_GRAPHS=0``) of up to ``PREFILL_GRAPH_ROWS`` tokens per padded shape; see
                :mod:`graphdsl.runtime.serving.cuda_graphs`.
            max_blocks_per_seq: the fixed ``block_tables`` width graphs pad to (default: every
                block of the bound cache); a step with a wider table runs eagerly.
        """
        if not isinstance(cuda_graphs, bool):
            raise GraphDSLError(f"configure_runtime: cuda_graphs must be a bool, got {cuda_graphs!r}")
        if max_blocks_per_seq is not None and (isinstance(max_blocks_per_seq, bool)
                                               or not isinstance(max_blocks_per_seq, int) or max_blocks_per_seq < 1):
            raise GraphDSLError(f"configure_runtime: max_blocks_per_seq must be a positive int or None, "
                                f"got {max_blocks_per_seq!r}")
        self._runtime.update(backend=backend, cuda_graphs=cuda_graphs, max_blocks_per_seq=max_blocks_per_seq)
        self._engines.clear()
        self._graph_runners.clear()
        self._prefill_runners.clear()

    # -- LoRA ----------------------------------------------------------------------------------
    def enable_lora(self, *, max_loras: int = 4, max_lora_rank: int = 16):
        """Give the model a LoRA slot pool (:class:`graphdsl.models.lora.LoRAManager`); steps whose
        inputs hold ``lora_indices`` then run the ``lora`` feature engines. Call after :meth:`bind`."""
        from .lora import LoRAManager
        object.__setattr__(self, "_lora", LoRAManager(self, max_loras=max_loras, max_lora_rank=max_lora_rank))
        for key in [k for k in self._engines if "lora" in k[1]]:
            del self._engines[key]
        return self._lora

    @property
    def lora(self):
        """The LoRA manager (None until :meth:`enable_lora`)."""
        return self._lora

    def execute(self, phase: Phase, inputs: Mapping[str, torch.Tensor], *, float_logits: bool = True) -> torch.Tensor:
        raise GraphDSLError(f"{type(self).__name__} is not runnable: decorate the class with @to_engine()")

    def engine(self, phase: Phase, lora: bool = False):
        raise GraphDSLError(f"{type(self).__name__} is not runnable: decorate the class with @to_engine()")


def to_engine(*features: str):
    """Class decorator making a :class:`FlashCausalLM` subclass runnable through cached engines.

    ``features`` name graph variants (LoRA, ...) this class builds in; the engine cache key is
    ``(phase, frozenset(features))``.
    """
    for f in features:
        if not isinstance(f, str):
            raise GraphDSLError(f"to_engine: features must be strings, got {f!r}")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, FlashCausalLM)):
            raise GraphDSLError(f"to_engine decorates FlashCausalLM subclasses, got {cls!r}")
        cls.engine_features = frozenset(features)
        cls.engine = _engine
        cls.execute = _execute
        return cls
    return deco


def _engine(self: FlashCausalLM, phase: Phase, lora: bool = False):
    """The engine for ``phase`` and this class's features (plus ``lora`` when asked: the graph with
    :func:`~graphdsl.layers.lora.lora_hook` terms on every target linear), recorded and built on
    first use."""
    if not isinstance(phase, Phase):
        raise GraphDSLError(f"phase must be a Phase, one of {[p.value for p in Phase]}, got {phase!r}")
    if self._cache_spec is None:
        raise GraphDSLError(f"{type(self).__name__}: call bind(weights, kv_caches, block_size) before running")
    if lora and self._lora is None:
        raise GraphDSLError(f"{type(self).__name__}: a LoRA step needs enable_lora() first")
    key = (phase, self.engine_features | {"lora"} if lora else self.engine_features)
    engine = self._engines.get(key)
    if engine is None:
        ctx = ForwardContext.symbolic(phase, self._cache_spec, self.config.rotary_dim)
        bound = self._bound
        with Network(f"{type(self).__name__}.{phase.value}{'.lora' if lora else ''}") as net:
            if lora:
                from graphdsl.layers.lora import lora_scope
                with lora_scope(self._lora.targets, self._lora.max_loras, self._lora.max_rank):
                    net.mark_output(self(ctx), "logits")
                bound = {**bound, **self._lora.buffers}
            else:
                net.mark_output(self(ctx), "logits")
        from .injection import device_labeller
        labels = device_labeller(self, self._home)
        if labels is None:
            engine = net.build_engine(device=self._home, backend=self._runtime["backend"])
        else:
            from graphdsl.passes.partition import partition_by_device
            from graphdsl.runtime.partitioned import PartitionedEngine
            engine = PartitionedEngine(partition_by_device(net, labels), device=self._home,
                                       backend=self._runtime["backend"])
        engine.set_weights({n: t for n, t in bound.items() if n in engine.net.inputs})
        self._engines[key] = engine
    return engine


def _execute(self: FlashCausalLM, phase: Phase, inputs: Mapping[str, torch.Tensor], *,
             float_logits: bool = True) -> torch.Tensor:
    """Run one step. ``inputs`` holds the :meth:`ForwardContext.input_names` tensors but cos/sin,
    which come from the rotary tables here; with ``lora_indices`` (int32 adapter slot of each token,
    -1: none) the step runs the ``lora`` engine. Returns float32 logits (the graph's, cast), or with
    ``float_logits=False`` the graph's own (the model's dtype: what a greedy serving step reads;
    the benchmarks time that step)."""
    engine = self.engine(phase, lora="lora_indices" in inputs)
    feed = dict(inputs)
    extra_in, extra_out, runtime_params = self._update_model_inputs(feed)
    feed.update(extra_in)
    names = engine.net.inputs
    tables = "cos" in names and "cos" not in feed     # the graph rotates q/k and no model input gave the tables
    if phase is Phase.DECODE and not (extra_in or extra_out or runtime_params):
        runner = _graph_runner(self, engine)
        if runner is not None:
            if "cos" in runner.pads and tables:
                feed["cos"], feed["sin"] = self.rotary.cos_sin(feed["positions"])
            step = {k: v for k, v in feed.items() if k in runner.pads}
            if runner.fits(step):
                logits = runner.run(step)["logits"]
                return logits.float() if float_logits else logits
    if tables and "cos" not in feed:
        feed["cos"], feed["sin"] = self.rotary.cos_sin(feed["positions"])
    step = {k: v for k, v in feed.items() if k in names}
    if phase is Phase.PREFILL and not (extra_in or extra_out or runtime_params or "lora_indices" in step):
        runner = _prefill_graphs(self, engine)
        out = runner.run(step) if runner is not None else None
        if out is not None:
            return out["logits"].float() if float_logits else out["logits"]
    out = engine.forward(step, extra_out or None, runtime_params or None)
    return out["logits"].float() if float_logits else out["logits"]


def decode_pads(max_blocks_per_seq: int) -> dict:
    """The padding of a decode step's inputs for a CUDA-graph bucket (see
    :mod:`graphdsl.runtime.serving.cuda_graphs`): padded rows write no cache slot (-1) and attend over no
    key (seq_len 0); ``block_tables`` keeps one fixed width."""
    from graphdsl.runtime.serving.cuda_graphs import Pad
    return {"input_ids": Pad(0), "positions": Pad(0), "cos": Pad(0.0), "sin": Pad(0.0), "slot_mapping": Pad(-1),
            "block_tables": Pad(0, width=max_blocks_per_seq), "seq_lens": Pad(0), "lora_indices": Pad(-1)}


def cuda_graphs_enabled(flag: bool) -> bool:
    """``flag`` unless ``GRAPHDSL_CUDA_GRAPHS=0`` turns graphs off."""
    return flag and env_flag("GRAPHDSL_CUDA_GRAPHS", True)


def _graphs_apply(self: FlashCausalLM, engine) -> bool:
    """Whether ``engine``'s steps may be captured: graphs on, a CUDA engine of the ``triton`` backend
    (the others' ops synchronise with the host) and no host-synchronising module. The modules are
    walked once per engine (it was traced from them as they were): the walk costs ~0.7 µs a module
    of host time, and every prefill step and every change of a decode batch's rows asks."""
    if not (cuda_graphs_enabled(self._runtime["cuda_graphs"]) and engine.device is not None
            and engine.device.type == "cuda" and engine.backend.name == "triton"):
        return False
    capturable = self._capturable.get(engine)
    if capturable is None:
        capturable = self._capturable[engine] = self.graph_capturable()
    return capturable


def _graph_runner(self: FlashCausalLM, engine):
    """The decode engine's CUDA-graph runner, or None when graphs do not apply (off, not CUDA, or a
    backend whose ops synchronise with the host: only ``triton`` is captured). The graph computes
    the RoPE tables and the cache slots from the positions and block tables itself (its prologue);
    its epilogue takes the greedy next token (``next_tokens``) and advances the static inputs to the
    next decode step of the same rows (see :func:`_decode_epilogue`)."""
    if not _graphs_apply(self, engine):
        return None
    runner = self._graph_runners.get(id(engine))
    if getattr(engine, "partition", None) is not None:        # placement rules: one graph per CUDA part
        if runner is None or runner.engine is not engine:
            from .partitioned_graphs import PartitionedGraphRunner
            width = self._runtime["max_blocks_per_seq"] or self._num_cache_blocks
            runner = self._graph_runners[id(engine)] = PartitionedGraphRunner(engine, decode_pads(width))
        return runner
    if runner is None or runner.engine is not engine:
        from graphdsl.runtime.serving.cuda_graphs import CudaGraphRunner
        width = self._runtime["max_blocks_per_seq"] or self._num_cache_blocks
        all_pads = decode_pads(width)
        pads = {k: p for k, p in all_pads.items() if k in engine.net.inputs and k not in engine._weights}
        rope = self.rotary is not None and self.rotary.captures_tables and {"cos", "sin"} <= set(pads)
        slots = "slot_mapping" in pads and {"block_tables", "seq_lens"} <= set(pads)
        prologue = None
        if rope or slots:
            pads = {k: p for k, p in pads.items() if not ((rope and k in ("cos", "sin")) or (slots and k == "slot_mapping"))}
            pads["positions"] = all_pads["positions"]
            prologue = _decode_prologue(self.rotary if rope else None, self._cache_spec.block_size if slots else None)
        runner = self._graph_runners[id(engine)] = CudaGraphRunner(engine, pads, prologue=prologue,
                                                                   epilogue=_decode_epilogue,
                                                                   widths=_decode_widths(self, engine))
    return runner


_DECODE_WIDTHS = True    # decode graphs at narrower block tables where the attention's grid shrinks


def _decode_widths(self: FlashCausalLM, engine):
    """``fn(bucket) -> widths``: the block-table widths the decode graphs of ``bucket`` rows are
    captured at (:func:`~graphdsl.runtime.kernels.paged_attention.decode_widths`, over the
    sliding windows of the engine's paged attentions), or None (one width, the model's) when the
    engine has no such attention, or another kind whose grid the rule does not know (MLA)."""
    ops = [n for n in engine.net.nodes if n.op in ("paged_attention", "rope_cache_attention")]
    if not _DECODE_WIDTHS or not ops or any(n.op == "paged_mla_attention" for n in engine.net.nodes):
        return None
    from graphdsl.runtime.kernels.paged_attention import decode_widths
    spec = self._cache_spec
    windows = sorted({int(n.attrs.get("sliding_window") or 0) for n in ops})
    width = self._runtime["max_blocks_per_seq"] or self._num_cache_blocks
    return lambda bucket: decode_widths(bucket, spec.num_kv_heads, width, spec.block_size, windows, engine.device)


PREFILL_GRAPH_ROWS = 2048  # prefill steps of at most this many tokens replay CUDA graphs (ShapeGraphRunner)
PREFILL_GRAPHS = 64        # prefill graphs kept: every token bucket up to 2048 tokens (57, prefill_pad) and a few more


def prefill_graphs_enabled() -> bool:
    """Prefill steps go through :class:`~graphdsl.runtime.serving.cuda_graphs.ShapeGraphRunner` unless
    ``GRAPHDSL_PREFILL_GRAPHS=0`` (and only while decode's CUDA graphs are on). On an H200 a 1B
    prefill of 16 tokens took 16.5 ms eagerly (host-bound launches) and 0.95 ms replayed
    (docs/performance-log.md, "Prefill graphs")."""
    return env_flag("GRAPHDSL_PREFILL_GRAPHS", True)


def _prefill_graphs(self: FlashCausalLM, engine):
    """The prefill engine's shape-keyed CUDA-graph runner, or None where graphs do not apply (as
    for decode: off, not CUDA, not the triton backend, a host-synchronising module, placement
    rules). The serving loop pads prefill steps to a few shapes (``prefill_pad``), so a shape
    recurs; a short step's host launches (one per node) cost more than its device time."""
    if not (prefill_graphs_enabled() and _graphs_apply(self, engine)) or getattr(engine, "partition", None):
        return None
    runner = self._prefill_runners.get(id(engine))
    if runner is None or runner.engine is not engine:
        from graphdsl.runtime.serving.cuda_graphs import ShapeGraphRunner
        runner = self._prefill_runners[id(engine)] = ShapeGraphRunner(engine, max_rows=PREFILL_GRAPH_ROWS,
                                                                            max_graphs=PREFILL_GRAPHS)
    return runner


def _decode_prologue(rotary, block_size: int | None):
    """The graph's prologue: RoPE tables and cache slots from the positions, in one launch
    (:func:`~graphdsl.runtime.kernels.step_inputs.decode_step_inputs`; the same values as
    ``rotary.cos_sin`` and :func:`~graphdsl.runtime.serving.kv_cache.decode_slots`, which took a
    dozen torch launches: in-model A/B on an H100, µs a step, Llama-3.2-1B batch 1 1118 -> 1101,
    batch 64 1687 -> 1667, Llama-3-8B batch 1 5585 -> 5562)."""
    from graphdsl.runtime.kernels.step_inputs import decode_step_inputs

    def prologue(static: Mapping[str, torch.Tensor]) -> dict:
        positions = static["positions"]
        args = {}
        if rotary is not None:
            args["inv_freq"], args["scale"] = rotary.device_inv_freq(positions.device)
        if block_size is not None:
            args.update(block_tables=static["block_tables"], seq_lens=static["seq_lens"], block_size=block_size)
        return decode_step_inputs(positions, **args)
    return prologue


def _decode_epilogue(static: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> dict:
    """Greedy next token of every row, and the static inputs advanced for the next step of the same
    rows: ``input_ids <- next token``, ``positions += 1`` and ``seq_lens += 1`` on real rows
    (``seq_lens > 0``; padding rows stay padding). The serving loop overwrites ``input_ids`` with
    sampled tokens when a row does not decode greedily; a caller that copies its inputs in before
    every replay (``CudaGraphRunner.run``) is not affected."""
    from graphdsl.runtime.kernels.sampling import argmax
    tokens = argmax(outputs["logits"], advance=(static["input_ids"], static["positions"], static["seq_lens"]))
    return {"next_tokens": tokens}
