"""``ModelExecutor``: a :class:`FlashCausalLM` as the serving loop's step executor.

It runs the model's prefill and decode engines eagerly (``execute``) and hands the loop the decode
engine's CUDA graph for a batch bucket (``decode_graph``): the graph's static inputs are the
loop's persistent decode buffers, its prologue derives RoPE tables and cache slots from them, and
its epilogue takes the greedy argmax, so a steady decode step is one graph replay.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdsl.layers import Phase
from graphdsl.runtime.serving.cuda_graphs import bucket_for

from .base import FlashCausalLM, _graph_runner

__all__ = ["ModelExecutor"]

_PHASES = {"prefill": Phase.PREFILL, "decode": Phase.DECODE}


@dataclass
class _BucketGraph:
    """One bucket of the decode engine's graph runner, as the loop's ``DecodeGraph``."""

    runner: object
    rows: int
    width: int
    inputs: dict

    def replay(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.runner.replay(self.rows, self.width)
        return out["logits"][:n], out["next_tokens"][:n]


class ModelExecutor:
    """Runs ``model``'s engines for :class:`graphdsl.runtime.serving.loop.ServingLoop`."""

    def __init__(self, model: FlashCausalLM, *, device: torch.device, block_size: int, max_blocks_per_seq: int):
        self.model, self.device = model, torch.device(device)
        self.vocab_size = model.config.vocab_size
        self.block_size, self.max_blocks_per_seq = block_size, max_blocks_per_seq

    def execute(self, phase: str, inputs: dict[str, torch.Tensor], rows: int | None = None) -> torch.Tensor:
        feed = dict(inputs)
        if phase == "decode":
            feed.pop("query_start_loc", None)
            feed.pop("lm_head_indices", None)
        logits = self.model.execute(_PHASES[phase], feed, float_logits=False)
        return (logits if rows is None else logits[:rows]).float()     # cast only the rows asked for

    def lora_slots(self, names: list[str | None]) -> list[int]:
        if self.model.lora is None:
            from graphdsl.runtime.loaders.peft import LoRAError
            raise LoRAError("a request names a LoRA adapter, but the model has no LoRA slots (load_lora first)")
        return self.model.lora.slots_for(names)

    def decode_graph(self, n: int, lora: bool = False, width: int | None = None):
        """The decode graph of the smallest bucket holding ``n`` rows and the narrowest block-table
        width of it holding ``width`` blocks (None: the widest), or None (no graphs here, the batch
        is larger than the largest bucket, or the model feeds extra inputs per step). With ``lora``
        it is the LoRA engine's, whose static inputs also hold ``lora_indices`` (the slot of each
        row, -1 on padding rows)."""
        model = self.model
        engine = model.engine(Phase.DECODE, lora=lora)
        runner = _graph_runner(model, engine)
        want = {"input_ids", "positions", "seq_lens", "block_tables"} | ({"lora_indices"} if lora else set())
        if runner is None or set(runner.pads) != want:
            return None
        extra_in, extra_out, params = model._update_model_inputs({})
        if extra_in or extra_out or params:
            return None
        bucket = bucket_for(n, runner.buckets)
        if bucket is None:
            return None
        wide = runner.width_for(bucket, width)
        like = {"input_ids": ((), torch.int64), "positions": ((), torch.int64), "seq_lens": ((), torch.int32),
                "block_tables": ((wide,), torch.int32), "lora_indices": ((), torch.int32)}
        return _BucketGraph(runner, bucket, wide, runner.static_inputs(bucket, like, self.device, wide))

    def decode_widths(self, n: int) -> tuple[int, ...]:
        """The block-table widths the decode graphs of the bucket holding ``n`` rows are captured at
        (ascending; ``()`` when decode runs without graphs)."""
        runner = _graph_runner(self.model, self.model.engine(Phase.DECODE))
        bucket = bucket_for(n, runner.buckets) if runner is not None else None
        if bucket is None or not hasattr(runner, "widths"):
            return ()
        return runner.widths(bucket)
