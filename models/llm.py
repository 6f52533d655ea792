"""``graphdsl.LLM``: load a checkpoint (HF directory or GGUF file), score and generate.

The loop is deliberately small (gpt-fast / nano-vLLM shape): sequences are admitted while their
whole budget (prompt + max_tokens) fits in the paged KV cache, prefilled together in one packed
step, then decoded one token per sequence per step until each stops. Engines come from the
model's ``@to_engine`` entry points; everything else here is host bookkeeping.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.layers import Phase
from graphdsl.runtime.kv_cache import BlockManager, PagedKVCache
from graphdsl.runtime.sampling import SamplingParams, make_generator, sample

from .base import FlashCausalLM
from .config import ModelConfig, build_config, read_hf_config
from .loader import load_weights
from .registry import load_custom_module_map, resolve_model_class

__all__ = ["LLM", "CompletionOutput"]


@dataclass
class CompletionOutput:
    """One finished request: ``finish_reason`` is ``"stop"`` (eos, stop token or string) or ``"length"``."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class _Seq:
    id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    generator: torch.Generator | None
    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_string_hit: bool = False
    decoder: object = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.out_ids


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLM:
    """A loaded model ready to score and generate.

    Args:
        model: a HF model directory (``config.json`` + safetensors) or a ``.gguf`` file.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available.
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or a torch dtype; default float32 on
            CPU, the checkpoint's dtype on CUDA.
        max_model_len: longest sequence (prompt + output); default ``min(max_position_embeddings, 2048)``.
        max_num_seqs: sequences decoded together; with ``max_model_len`` it sizes the KV cache.
        kv_cache_memory_fraction: size the cache from this fraction of free device memory instead.
        block_size: tokens per KV-cache block.
        custom_module_map: a ``.py`` file registering extra or replacement models.
        tensor_parallel_size: only 1 for now.
        progress: print loading progress on stderr.
    """

    def __init__(self, model: str | os.PathLike, *, device: str | torch.device | None = None, dtype=None,
                 max_model_len: int | None = None, max_num_seqs: int = 4, kv_cache_memory_fraction: float | None = None,
                 block_size: int = 16, custom_module_map: str | os.PathLike | None = None,
                 tensor_parallel_size: int = 1, progress: bool = False):
        if tensor_parallel_size != 1:
            raise GraphDSLError(f"tensor_parallel_size must be 1 for now, got {tensor_parallel_size!r}")
        for name, v in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_model_len", 1 if max_model_len is None else max_model_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GraphDSLError(f"LLM: {name} must be a positive int, got {v!r}")
        if custom_module_map is not None:
            load_custom_module_map(custom_module_map)
        path = os.fspath(model)
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.gguf = path.endswith(".gguf")
        if self.gguf:
            from graphdsl.runtime.gguf import GGUFCheckpoint
            if not os.path.isfile(path):
                raise GraphDSLError(f"GGUF file {path!r} does not exist")
            ckpt = GGUFCheckpoint(path)
            hf = ckpt.hf_config()
        elif os.path.isdir(path):
            hf = read_hf_config(path)
        else:
            raise GraphDSLError(f"model {path!r} is neither a model directory nor a .gguf file")
        self.config: ModelConfig = build_config(hf)
        if max_model_len is not None and max_model_len > self.config.max_position_embeddings:
            raise GraphDSLError(f"LLM: max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                                f"{self.config.max_position_embeddings}")
        self.dtype = _pick_dtype(dtype, self.device, self.config)
        cls = resolve_model_class(self.config.model_type, self.config.architectures)
        self.model: FlashCausalLM = cls(self.config, self.dtype)
        tensors = ckpt.iter_tensors(self.dtype, device=self.device) if self.gguf else _iter_dir(path, self.dtype)
        weights = load_weights(self.model, tensors, device=self.device, dtype=self.dtype, progress=progress)
        self.tokenizer = _load_tokenizer(ckpt if self.gguf else None, path)

        cfg = self.config
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 2048)
        self.max_num_seqs, self.block_size = max_num_seqs, block_size
        if kv_cache_memory_fraction is not None:
            num_blocks = PagedKVCache.blocks_for_memory(kv_cache_memory_fraction, cfg.num_hidden_layers,
                                                        cfg.num_key_value_heads, cfg.head_dim, block_size=block_size,
                                                        dtype=self.dtype, device=self.device)
        else:
            num_blocks = PagedKVCache.blocks_for(self.max_model_len, max_num_seqs, block_size)
        self.kv_cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     num_blocks=num_blocks, block_size=block_size, dtype=self.dtype, device=self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.model.bind(weights, zip(self.kv_cache.key_caches, self.kv_cache.value_caches), block_size)
        self._ids = itertools.count()
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = eos

    def __repr__(self):
        return (f"LLM({type(self.model).__name__}, layers={self.config.num_hidden_layers}, "
                f"hidden={self.config.hidden_size}, dtype={self.dtype}, device={self.device}, "
                f"max_model_len={self.max_model_len}, {self.kv_cache})")

    # -- scoring -----------------------------------------------------------------------------
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits ``[len(token_ids), vocab]``: row i predicts token i + 1."""
        ids = self._check_ids(token_ids, "token_ids", allow_full=True)
        seq = _Seq(next(self._ids), None, ids, SamplingParams(), 0, None)
        if not self.blocks.can_allocate(len(ids)):
            raise GraphDSLError(f"score: {len(ids)} tokens need {self.blocks.blocks_needed(len(ids))} KV blocks, "
                                f"only {self.blocks.num_free_blocks} are free")
        self.blocks.allocate(seq.id, len(ids))
        try:
            return self._prefill([seq], all_logits=True)
        finally:
            self.blocks.free(seq.id)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | dict | None = None, *,
                 use_chat_template: bool = False) -> list[CompletionOutput]:
        """Complete each prompt. ``prompts``: a string, a list of strings, a list of token ids, or a
        list of token-id lists; ``params``: one :class:`SamplingParams` for all or one per prompt."""
        seqs = self._make_seqs(prompts, params, use_chat_template)
        for _ in self._run(seqs):
            pass
        return [self._output(s) for s in seqs]

    def stream(self, prompt, params: SamplingParams | dict | None = None, *,
               use_chat_template: bool = False) -> Iterator[str]:
        """Yield the completion of one prompt piece by piece as tokens are generated."""
        seqs = self._make_seqs([prompt] if isinstance(prompt, str) else [list(prompt)], params, use_chat_template)
        if self.tokenizer is None:
            raise GraphDSLError("stream needs a tokenizer; this checkpoint has none")
        seq = seqs[0]
        hold = max((len(x) for x in seq.params.stop), default=1) - 1   # a stop string may be forming
        emitted = 0
        for _ in self._run(seqs):
            text = self._output(seq).text if seq.finish_reason else seq.text[:max(len(seq.text) - hold, 0)]
            if len(text) > emitted:
                yield text[emitted:]
                emitted = len(text)

    def chat(self, messages: list[dict], params: SamplingParams | dict | None = None) -> CompletionOutput:
        """Answer a chat (``[{"role": ..., "content": ...}, ...]``) with the model's chat template."""
        tok = self._tokenizer_or_error("chat")
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        out = self.generate([tok.encode(prompt, add_special_tokens=False)], params)[0]   # the template has BOS
        out.prompt = prompt
        return out

    # -- internals ---------------------------------------------------------------------------
    def _tokenizer_or_error(self, what: str):
        if self.tokenizer is None:
            raise GraphDSLError(f"{what} needs a tokenizer, but this checkpoint has no tokenizer.json "
                                "(pass token ids instead)")
        return self.tokenizer

    def _make_seqs(self, prompts, params, use_chat_template: bool) -> list[_Seq]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise GraphDSLError(f"prompts must be a non-empty list of strings or token-id lists, got {prompts!r}")
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise GraphDSLError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        plist = [SamplingParams.model_validate(p) if isinstance(p, dict) else p for p in plist]
        for i, p in enumerate(plist):
            if not isinstance(p, SamplingParams):
                raise GraphDSLError(f"params[{i}] must be a SamplingParams or dict, got {type(p).__name__}")
        seqs = []
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
            max_new = min(p.max_tokens, self.max_model_len - len(ids))
            seq = _Seq(next(self._ids), text, ids, p, max_new, make_generator(p, self.device))
            if self.tokenizer is not None:
                from graphdsl.runtime.tokenizer import StreamDecoder
                seq.decoder = StreamDecoder(self.tokenizer)
            seqs.append(seq)
        return seqs

    def _check_ids(self, ids, what: str, allow_full: bool = False) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise GraphDSLError(f"{what} must be a string or a list of int token ids, got {ids!r:.80}")
        if not ids:
            raise GraphDSLError(f"{what} is empty: give at least one token")
        limit = self.max_model_len if allow_full else self.max_model_len - 1
        if len(ids) > limit:
            raise GraphDSLError(f"{what} has {len(ids)} tokens, more than max_model_len={self.max_model_len} allows "
                                f"({limit}{'' if allow_full else ', leaving room for one generated token'}); "
                                "shorten it or raise max_model_len")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise GraphDSLError(f"{what} holds token ids outside [0, {vocab}): {bad[:8]}")
        return list(ids)

    def _budget(self, seq: _Seq) -> int:
        return self.blocks.blocks_needed(len(seq.prompt_ids) + seq.max_new)

    def _run(self, seqs: list[_Seq]) -> Iterator[tuple[_Seq, int]]:
        """Drive ``seqs`` to completion, yielding ``(seq, token)`` as each token is produced."""
        for s in seqs:
            if self._budget(s) > self.blocks.num_blocks:
                raise GraphDSLError(f"a request of {len(s.prompt_ids)} prompt tokens + {s.max_new} new tokens needs "
                                    f"{self._budget(s)} KV blocks, the cache has {self.blocks.num_blocks}")
        waiting, running = list(seqs), []
        try:
            while waiting or running:
                admitted = []
                reserved = sum(self._budget(s) for s in running)
                while waiting and len(running) + len(admitted) < self.max_num_seqs \
                        and reserved + self._budget(waiting[0]) <= self.blocks.num_blocks:
                    s = waiting.pop(0)
                    reserved += self._budget(s)
                    self.blocks.allocate(s.id, len(s.prompt_ids))
                    admitted.append(s)
                if admitted:
                    logits = self._prefill(admitted)
                    yield from self._accept(admitted, logits)
                    running += admitted
                else:
                    for s in running:
                        self.blocks.append(s.id, 1)
                    logits = self._decode(running)
                    yield from self._accept(running, logits)
                for s in [s for s in running if s.finish_reason]:
                    self.blocks.free(s.id)
                    running.remove(s)
        finally:
            for s in running:
                if s.id in self.blocks:
                    self.blocks.free(s.id)

    def _accept(self, seqs: list[_Seq], logits: torch.Tensor) -> Iterator[tuple[_Seq, int]]:
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], [s.all_ids for s in seqs])
        for s, tok in zip(seqs, tokens.tolist()):
            s.out_ids.append(tok)
            p = s.params
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                s.finish_reason = "stop"
            else:
                if s.decoder is not None:
                    s.text += s.decoder.push(tok)
                    hit = [s.text.find(x) for x in p.stop if x in s.text]
                    if hit:
                        s.text = s.text[:min(hit)]
                        s.finish_reason, s.stop_string_hit = "stop", True
                if not s.finish_reason and len(s.out_ids) >= s.max_new:
                    s.finish_reason = "length"
            yield s, tok

    def _output(self, s: _Seq) -> CompletionOutput:
        """The finished request; text is the full decode unless a stop string cut it."""
        text = s.text
        if self.tokenizer is not None and not s.stop_string_hit:
            text = self.tokenizer.decode(s.out_ids, skip_special_tokens=True)
        return CompletionOutput(s.prompt, s.prompt_ids, text, list(s.out_ids), s.finish_reason or "length")

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, seqs: list[_Seq]) -> torch.Tensor:
        tables = [self.blocks.block_table(s.id) for s in seqs]
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def _prefill(self, seqs: list[_Seq], all_logits: bool = False) -> torch.Tensor:
        ids, pos, slots, qsl, heads = [], [], [], [0], []
        for s in seqs:
            n = len(s.prompt_ids)
            ids += s.prompt_ids
            pos += range(n)
            slots += self.blocks.slot_mapping(s.id, 0, n)
            heads += range(qsl[-1], qsl[-1] + n) if all_logits else [qsl[-1] + n - 1]
            qsl.append(qsl[-1] + n)
        inputs = {"input_ids": self._tensor(ids, torch.int64), "positions": self._tensor(pos, torch.int64),
                  "slot_mapping": self._tensor(slots, torch.int64), "block_tables": self._block_tables(seqs),
                  "seq_lens": self._tensor([len(s.prompt_ids) for s in seqs], torch.int32),
                  "query_start_loc": self._tensor(qsl, torch.int32),
                  "lm_head_indices": self._tensor(heads, torch.int64)}
        return self.model.execute(Phase.PREFILL, inputs)

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        ids, pos, slots, lens = [], [], [], []
        for s in seqs:
            n = self.blocks.num_tokens(s.id)        # includes the token fed now
            ids.append(s.out_ids[-1])
            pos.append(n - 1)
            slots += self.blocks.slot_mapping(s.id, n - 1, n)
            lens.append(n)
        inputs = {"input_ids": self._tensor(ids, torch.int64), "positions": self._tensor(pos, torch.int64),
                  "slot_mapping": self._tensor(slots, torch.int64), "block_tables": self._block_tables(seqs),
                  "seq_lens": self._tensor(lens, torch.int32)}
        return self.model.execute(Phase.DECODE, inputs)


def _pick_dtype(dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else (config.dtype if config.dtype != torch.float32 else torch.bfloat16)
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise GraphDSLError(f"dtype must be one of {sorted(_DTYPES)} (or a matching torch dtype), got {dtype!r}")


def _iter_dir(path: str, dtype) -> Iterable[tuple[str, torch.Tensor]]:
    from graphdsl.runtime.weights import iter_safetensors
    return iter_safetensors(path, dtype=dtype)


def _load_tokenizer(gguf_ckpt, path: str):
    if gguf_ckpt is not None:
        return gguf_ckpt.tokenizer()
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from graphdsl.runtime.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(path)
