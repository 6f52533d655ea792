"""Many random requests through ``LLM.generate`` on a KV pool small enough to force preemption;
each output must equal the same request run alone. Shared by the CPU test (tests/models) and the
GPU soak (tests/gpu/test_soak.py)."""
from __future__ import annotations

import random
import time

import graphdsl as gd

# a tiny Llama; weights are drawn wide (init_std) so the logits are far from ties and the
# batched and one-by-one runs (different matmul shapes, prefill vs decode kernels) pick the same tokens
# (head_dim 32 and block_size 16: shapes the Triton attention kernels are tested at)
TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def tiny_llm(device: str, *, num_kv_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
             max_model_len: int = 64, block_size: int = 16) -> gd.LLM:
    return gd.LLM.from_config(TINY_LLAMA, device=device, dtype="float32", seed=0, init_std=0.15,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
                              block_size=block_size)


def random_requests(n: int, seed: int, *, vocab: int = 256, max_prompt: int = 40, max_new: int = 20):
    """``n`` (prompt ids, SamplingParams): half greedy, half seeded top-k/top-p sampling."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        if i % 2:
            sp = gd.SamplingParams(max_tokens=rng.randint(1, max_new), temperature=rng.choice([0.7, 1.0]),
                                   top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=10_000 + i,
                                   ignore_eos=True)
        else:
            sp = gd.SamplingParams(max_tokens=rng.randint(1, max_new), temperature=0.0, ignore_eos=True)
        out.append((prompt, sp))
    return out


def soak(llm: gd.LLM, requests, *, log=print) -> dict:
    """Run ``requests`` together, then each alone; assert equal outputs, every block returned and
    preemptions > 0. Returns counts and times."""
    before = llm.num_preemptions
    t0 = time.perf_counter()
    together = llm.generate([p for p, _ in requests], [sp for _, sp in requests])
    t_together = time.perf_counter() - t0
    preemptions = llm.num_preemptions - before
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks, "blocks leaked after the batched run"
    assert preemptions > 0, (f"the pool of {llm.blocks.num_blocks} blocks was meant to force preemption "
                             f"for {len(requests)} requests")
    log(f"together: {len(requests)} requests in {t_together:.1f}s, {preemptions} preemptions")
    t0 = time.perf_counter()
    mismatches = []
    for i, ((prompt, sp), out) in enumerate(zip(requests, [o.outputs[0] for o in together])):
        assert len(out.token_ids) == sp.max_tokens and out.finish_reason == "length", \
            f"request {i}: {len(out.token_ids)} tokens, finish {out.finish_reason!r}; expected {sp.max_tokens}, 'length'"
        alone = llm.generate([prompt], sp)[0].outputs[0]
        if alone.token_ids != out.token_ids:
            mismatches.append(f"request {i} (prompt {len(prompt)} tokens, {sp}): together {out.token_ids} "
                              f"alone {alone.token_ids}")
        if i % 100 == 99:
            log(f"alone: {i + 1}/{len(requests)} compared, {time.perf_counter() - t0:.1f}s")
    assert not mismatches, f"{len(mismatches)} of {len(requests)} differ from their one-by-one run:\n" + \
        "\n".join(mismatches[:5])
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks
    return {"requests": len(requests), "preemptions": preemptions, "together_s": t_together,
            "alone_s": time.perf_counter() - t0}
