"""Tensor parallelism on the CPU over gloo: collectives as graph ops, the shard transform, sliced
loading (bytes read per rank), and whole models at world sizes 2 and 4 against the single-process
run (logits and greedy tokens) — llama, qwen2-MoE (tensor- and expert-parallel) and an odd llama
(one KV head for 2 and 4 ranks, a vocabulary no world size divides). Also ``LLM(tensor_parallel_size)``
spawning its own workers, and a worker crash surfacing as an error naming the rank."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import graphdsl as gd
from graphdsl import Dim, Network, Tensor
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError
from graphdsl.layers.tensor_parallel import TensorParallel, shard_tensor_parallel
from graphdsl.models.config import build_config, read_hf_config
from graphdsl.models.loader import load_weights
from graphdsl.models.registry import resolve_model_class
from graphdsl.models.tensor_parallel import shard_model
from graphdsl.runtime.loaders.safetensors import ReadStats, iter_safetensors, iter_safetensors_lazy
from tests.helpers.tp_ranks import run_ranks
from tests.models.hf_tiny import make_checkpoint

IDS = [3, 17, 42, 99, 7, 150]
NEW = 5
ODD = dict(num_key_value_heads=1, vocab_size=163)          # KV heads < ranks, vocab padded per rank


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for name, family, kw in (("llama", "llama", {}), ("qwen2_moe", "qwen2_moe", {}), ("odd", "llama", ODD),
                             ("gemma", "gemma", {})):
        make_checkpoint(family, root / name, **kw)
        out[name] = str(root / name)
    return out


def _reference(path: str, **kw):
    llm = gd.LLM(path, device="cpu", num_kv_blocks=16, **kw)
    sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return llm.score(IDS), llm.generate([IDS], sp)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def references():
    """The single-process run of a checkpoint (logits, greedy tokens), made once per module."""
    done = {}

    def get(path: str):
        if path not in done:
            done[path] = _reference(path)
        return done[path]
    return get


# -- what every rank runs (torchrun's environment is set by run_ranks) ------------------------------
def _collectives(rank: int, world: int) -> None:
    """all_reduce / all_gather / reduce_scatter nodes in an engine equal their definitions."""
    from graphdsl.runtime.distributed import init_distributed
    init_distributed(rank, world, torch.device("cpu"))
    with Network() as net:
        x = Tensor("x", (Dim("n"), 4 * world), torch.float32)
        net.mark_output(F.all_reduce(x, world_size=world), "ar")
        net.mark_output(F.all_gather(x, dim=-1, world_size=world), "ag")
        net.mark_output(F.all_gather(x, dim=0, world_size=world), "ag0")
        net.mark_output(F.reduce_scatter(x, dim=-1, world_size=world), "rs")
    xs = [torch.arange(3 * 4 * world, dtype=torch.float32).reshape(3, -1) * (r + 1) for r in range(world)]
    out = net.build_engine(device="cpu", backend="torch").forward({"x": xs[rank]})
    total = sum(xs)
    torch.testing.assert_close(out["ar"], total, rtol=0, atol=0)
    torch.testing.assert_close(out["ag"], torch.cat(xs, -1), rtol=0, atol=0)
    torch.testing.assert_close(out["ag0"], torch.cat(xs, 0), rtol=0, atol=0)
    torch.testing.assert_close(out["rs"], total.chunk(world, -1)[rank], rtol=0, atol=0)


def _models(rank: int, world: int, cases: list) -> dict:
    _collectives(rank, world)
    out = {}
    sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for name, path, kw in cases:
        try:
            llm = gd.LLM(path, device="cpu", tensor_parallel_size=world, num_kv_blocks=16, **kw)
        except SystemExit:           # a worker rank: it followed rank 0's steps until close()
            continue
        out[name] = (llm.score(IDS), llm.generate([IDS], sp)[0].outputs[0].token_ids)
        llm.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_models_match_single_process(ckpts, references, world):
    cases = [("llama", ckpts["llama"], {}), ("qwen2_moe", ckpts["qwen2_moe"], {}), ("odd", ckpts["odd"], {})]
    if world == 2:            # expert parallel; a tied, scaled embedding shared with the vocab-parallel LM head
        cases += [("qwen2_moe_ep", ckpts["qwen2_moe"], {"expert_parallel": True}), ("gemma", ckpts["gemma"], {})]
    got = run_ranks(world, _models, cases)
    for name, path, _ in cases:
        logits, tokens = references(path)
        assert got[name][0].shape == logits.shape, name
        torch.testing.assert_close(got[name][0], logits, rtol=1e-4, atol=1e-4, msg=name)
        assert got[name][1] == tokens, name


# -- sliced loading: each rank reads only its bytes -------------------------------------------------
def _expected_bytes(path: str, world: int, rank: int) -> int:
    """Bytes rank ``rank`` must read, from the checkpoint's names and shapes alone: column-split
    tensors lose rows, row-split ones columns, K/V keep at least one head, norms and routers whole."""
    hf = read_hf_config(path)
    kv, d = hf["num_key_value_heads"], hf["hidden_size"] // hf["num_attention_heads"]
    total = 0
    for name, t in iter_safetensors(path):
        rows = t.shape[0]
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            n = max(1, kv // world) * d * (t.numel() // rows)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            per = -(-rows // world)
            n = max(0, min(per, rows - rank * per)) * t.shape[1]
        elif name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
            n = t.numel() // world
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            n = t.numel() // world
        else:                                          # norms, router, shared-expert gate
            n = t.numel()
        total += n * t.element_size()
    return total


@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "odd"])
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_loading_reads_only_each_ranks_slices(ckpts, name, world):
    path = ckpts[name]
    config = build_config(read_hf_config(path))
    cls = resolve_model_class(config.model_type, config.architectures)
    full_model = cls(config, torch.float32)
    full = load_weights(full_model, iter_safetensors(path), device="cpu")
    file_bytes = sum(t.numel() * t.element_size() for _, t in iter_safetensors(path))
    h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for rank in range(world):
        model = shard_model(cls(config, torch.float32), TensorParallel(rank, world))
        stats = ReadStats()
        shard = load_weights(model, iter_safetensors_lazy(path, stats=stats), device="cpu")
        assert stats.bytes == _expected_bytes(path, world, rank)
        assert stats.bytes < file_bytes * (0.75 if world == 2 else 0.5)
        # the shard holds exactly the rank's slices of the whole weights
        hl, kl = h // world, max(1, kv // world)
        kv0 = rank * kv // world if kv >= world else rank // (world // kv)
        q, k, v = full["model.layers.0.self_attn.qkv_proj.weight"].split([h * d, kv * d, kv * d])
        want = torch.cat([q[rank * hl * d:(rank + 1) * hl * d], k[kv0 * d:(kv0 + kl) * d], v[kv0 * d:(kv0 + kl) * d]])
        torch.testing.assert_close(shard["model.layers.0.self_attn.qkv_proj.weight"], want, rtol=0, atol=0)
        o = full["model.layers.0.self_attn.o_proj.weight"]
        torch.testing.assert_close(shard["model.layers.0.self_attn.o_proj.weight"],
                                   o[:, rank * hl * d:(rank + 1) * hl * d], rtol=0, atol=0)
        emb, per = full["model.embed_tokens.weight"], -(-config.vocab_size // world)
        mine = shard["model.embed_tokens.weight"]
        valid = max(0, min(per, config.vocab_size - rank * per))
        torch.testing.assert_close(mine[:valid], emb[rank * per:rank * per + valid], rtol=0, atol=0)
        assert not mine[valid:].any()                   # padding rows are zero


# -- LLM(tensor_parallel_size=N) owns its workers ---------------------------------------------------
def test_llm_spawns_workers_and_a_worker_crash_names_the_rank(ckpts, references):
    logits, tokens = references(ckpts["llama"])
    llm = gd.LLM(ckpts["llama"], device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    try:
        sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        assert llm.generate([IDS], sp)[0].outputs[0].token_ids == tokens
        torch.testing.assert_close(llm.score(IDS), logits, rtol=1e-4, atol=1e-4)
        worker = llm._tp.pool.procs[0]
        threading.Timer(0.2, worker.kill).start()        # dies while rank 0 is generating
        t0 = time.monotonic()
        with pytest.raises(GraphDSLError, match=r"worker rank 1 died \(killed by signal 9\)"):
            llm.generate([IDS], gd.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - t0 < 30
        with pytest.raises(GraphDSLError, match="tensor-parallel group is broken"):
            llm.score(IDS)
    finally:
        llm.close()
    import torch.distributed as dist
    assert not dist.is_initialized()


@pytest.mark.parametrize("kill_at", [1, 3])
def test_a_worker_killed_the_moment_a_step_is_announced_is_an_error_not_a_hang(ckpts, kill_at, monkeypatch):
    """The CPU twin of the GPU test of that name: the worker is killed right after rank 0 has
    announced a step (the prefill at 1, a decode step at 3), before rank 0 runs its own shard, whose
    collectives then have no peer. The step fails, the error names the worker, and nothing waits
    for the collectives' timeout; the group is broken and the LLM closes."""
    import os
    import signal

    from graphdsl.entrypoints import tp_driver
    llm = gd.LLM(ckpts["llama"], device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    try:
        pid, calls = llm._tp.pool.procs[0].pid, []
        announced = tp_driver.Driver.announced

        def kill_after_announcing(self, announce, run):
            calls.append(1)
            if len(calls) != kill_at:
                return announced(self, announce, run)
            return announced(self, announce, lambda: (os.kill(pid, signal.SIGKILL), run())[1])
        monkeypatch.setattr(tp_driver.Driver, "announced", kill_after_announcing)
        t0 = time.monotonic()
        with pytest.raises(GraphDSLError, match=r"worker rank 1 died \(killed by signal 9\)"):
            llm.generate([IDS], gd.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - t0 < 30 and len(calls) >= kill_at
        with pytest.raises(GraphDSLError, match="tensor-parallel group is broken"):
            llm.score(IDS)
    finally:
        llm.close()


def test_from_config_ranks_hold_slices_of_the_single_process_weights():
    """The benchmarks' path: every rank draws the random checkpoint whole and keeps its slices, so
    TP2 is the single-process model split (``benchmarks/tp.py`` compares greedy tokens; when each
    rank drew only its own shard, TP2 was another model and its tokens differed from the first)."""
    from tests.models.hf_tiny import make_config
    hf = make_config("llama").to_dict()
    sp = gd.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with gd.LLM.from_config(hf, device="cpu", seed=3, num_kv_blocks=16) as one:
        logits, tokens = one.score(IDS), one.generate([IDS], sp)[0].outputs[0].token_ids
        whole = one.model._bound["model.layers.0.self_attn.qkv_proj.weight"]
    with gd.LLM.from_config(hf, device="cpu", seed=3, tensor_parallel_size=2, num_kv_blocks=16) as llm:
        assert tuple(llm.model.model.layers[0].self_attn.qkv_proj.weight.shape) == (64, 64)
        assert llm.kv_cache.key_caches[0].shape[2] == 1
        torch.testing.assert_close(llm.score(IDS), logits, rtol=1e-4, atol=1e-4)
        assert llm.generate([IDS], sp)[0].outputs[0].token_ids == tokens
    with gd.LLM.from_config(hf, device="cpu", seed=4, num_kv_blocks=16) as other:
        assert not torch.equal(other.model._bound["model.layers.0.self_attn.qkv_proj.weight"], whole)  # seeded


@pytest.mark.parametrize("quantization, tol", [("int4-g64", 1e-4), ("int8", 2e-2), ("fp8", 5e-2)])
def test_online_quantization_quantizes_each_ranks_shard(quantization, tol):
    """``quantization=`` with ``tensor_parallel_size=2``: every rank quantizes its own slices. Groups
    of 64 lie inside every shard, so int4-g64 is the single-process quantized model split; int8's and
    fp8's per-row scales of a row-parallel shard cover its half of the inputs (finer than one
    process's), so logits differ within their rounding and the greedy tokens agree."""
    from graphdsl.layers.quantize import scheme_counts
    from tests.models.hf_tiny import make_config
    hf = make_config("llama", hidden_size=128, intermediate_size=256).to_dict()
    sp = gd.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(device="cpu", seed=3, num_kv_blocks=16, quantization=quantization)
    with gd.LLM.from_config(hf, **kw) as one:
        logits, tokens, counts = one.score(IDS), one.generate([IDS], sp)[0].outputs[0].token_ids, \
            scheme_counts(one.model)
    with gd.LLM.from_config(hf, tensor_parallel_size=2, **kw) as two:
        assert scheme_counts(two.model) == counts
        torch.testing.assert_close(two.score(IDS), logits, rtol=tol, atol=tol * logits.abs().max().item())
        assert two.generate([IDS], sp)[0].outputs[0].token_ids == tokens
    with pytest.raises(GraphDSLError, match=r"'model.layers.0.self_attn.o_proj.weight' has 64 inputs, not a multiple "
                                            r"of the group size 128 \(a rank's shard at tensor_parallel_size=2"):
        gd.LLM.from_config(hf, tensor_parallel_size=2, **dict(kw, quantization="int4-g128"))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_online_quantization_stores_each_ranks_expert_stacks(expert_parallel):
    """A Qwen2-MoE quantized ``int4-g64`` at ``tensor_parallel_size=2``: each rank stores its experts
    quantized — its half of every expert's intermediate rows (tensor parallel; groups of 64 lie
    inside the shard) or its half of the experts whole (expert parallel) — so the split model is
    the single-process quantized one: same logits, same greedy tokens."""
    from tests.models.hf_tiny import make_config
    hf = make_config("qwen2_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                     shared_expert_intermediate_size=128).to_dict()
    sp = gd.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(device="cpu", seed=3, num_kv_blocks=16, quantization="int4-g64")
    with gd.LLM.from_config(hf, **kw) as one:
        logits, tokens = one.score(IDS), one.generate([IDS], sp)[0].outputs[0].token_ids
        assert one.model._bound["model.layers.0.mlp.experts.down_proj_scale"].shape == (4, 128, 2)
    with gd.LLM.from_config(hf, tensor_parallel_size=2, expert_parallel=expert_parallel, **kw) as two:
        stack = two.model.model.layers[0].mlp.experts.down_proj
        assert stack.quant.name == "int4-g64"
        assert two.model._bound[f"{stack.name}_scale"].shape == ((2, 128, 2) if expert_parallel else (4, 128, 1))
        torch.testing.assert_close(two.score(IDS), logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())
        assert two.generate([IDS], sp)[0].outputs[0].token_ids == tokens


def test_kv_cache_memory_fraction_gives_every_rank_the_fewest_blocks(ckpts, references):
    """Each rank sizes its cache from its own free memory; the ranks then hold the least count."""
    logits, tokens = references(ckpts["llama"])
    with gd.LLM(ckpts["llama"], device="cpu", tensor_parallel_size=2, kv_cache_memory_fraction=0.001) as llm:
        store = llm._tp.pool.store
        counts = [int(store.get(f"kv_blocks/{r}")) for r in range(2)]
        assert llm.blocks.num_blocks == min(counts) and llm.kv_cache.key_caches[0].shape[0] == min(counts)
        sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        assert llm.generate([IDS], sp)[0].outputs[0].token_ids == tokens


def _fraction_under_torchrun(rank: int, world: int, path: str):
    try:
        llm = gd.LLM(path, device="cpu", tensor_parallel_size=world, kv_cache_memory_fraction=0.001)
    except SystemExit:                   # a worker rank, done once rank 0 closed its LLM
        return None
    blocks = llm.blocks.num_blocks
    sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    out = llm.generate([IDS], sp)[0].outputs[0].token_ids
    llm.close()
    return blocks, out


def test_kv_cache_memory_fraction_under_torchrun(ckpts, references):
    _, tokens = references(ckpts["llama"])
    blocks, out = run_ranks(2, _fraction_under_torchrun, ckpts["llama"])
    assert blocks >= 1 and out == tokens


def test_agree_min_through_a_store():
    from torch.distributed import TCPStore
    from graphdsl.runtime.distributed.workers import WorkerError, agree_min
    from tests.helpers.tp_ranks import _free_port
    port = _free_port()
    store = TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    got = {}
    threads = [threading.Thread(target=lambda r, v: got.__setitem__(r, agree_min(store, r, 3, "k", v, timeout_s=10)),
                                args=(r, v)) for r, v in ((0, 5), (1, 3), (2, 9))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got == {0: 3, 1: 3, 2: 3}
    with pytest.raises(WorkerError, match=r"did not agree on 'late' within 0s: \['late/1'\]"):
        agree_min(store, 0, 2, "late", 4, timeout_s=0.05)

    def dead():
        raise WorkerError("worker rank 1 died")
    with pytest.raises(WorkerError, match="worker rank 1 died"):
        agree_min(store, 0, 2, "dead", 4, timeout_s=10, check=dead)


def test_llm_close_ends_workers(ckpts):
    llm = gd.LLM(ckpts["odd"], device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    procs = list(llm._tp.pool.procs)
    llm.close()
    assert all(p.exitcode == 0 for p in procs)
    with pytest.raises(GraphDSLError, match="tensor-parallel group is closed"):
        llm.score(IDS)


# -- the transform's contract -----------------------------------------------------------------------
def _tiny(family="llama", **kw):
    from tests.models.hf_tiny import make_config
    hf = make_config(family, **kw).to_dict()
    config = build_config(hf)
    return resolve_model_class(config.model_type, config.architectures)(config, torch.float32)


def test_shard_shapes_follow_the_specs():
    m = shard_model(_tiny(), TensorParallel(1, 2))
    attn = m.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert tuple(attn.qkv_proj.weight.shape) == ((2 + 1 + 1) * 16, 64)
    assert tuple(attn.o_proj.weight.shape) == (64, 32)
    assert tuple(m.model.layers[0].mlp.gate_up_proj.weight.shape) == (96, 64)
    assert tuple(m.model.layers[0].mlp.down_proj.weight.shape) == (64, 48)
    assert tuple(m.model.embed_tokens.weight.shape) == (80, 64)
    assert tuple(m.model.norm.weight.shape) == (64,)
    assert shard_tensor_parallel(_tiny(), 0, 1) is not None       # world size 1: unchanged
    assert tuple(_tiny().model.layers[0].self_attn.qkv_proj.weight.shape) == (128, 64)


@pytest.mark.parametrize("kw, world, match", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 8, r"num_heads \(4\) must be a multiple of the world size \(8\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96}, 4,
     r"num_heads \(6\) must be a multiple"),
    ({"intermediate_size": 90}, 4, r"part 'gate_proj' \(90\) must be a multiple of the world size \(4\)"),
])
def test_unshardable_geometry_is_an_error(kw, world, match):
    with pytest.raises(GraphDSLError, match=match):
        shard_model(_tiny(**kw), TensorParallel(0, world))


def test_unsupported_layers_and_arguments_are_errors():
    with pytest.raises(GraphDSLError, match="multi-head latent attention"):
        shard_model(_tiny("deepseek_v2"), TensorParallel(0, 2))
    with pytest.raises(GraphDSLError, match="q/k/v layout 'per_head' is not supported"):
        shard_model(_tiny("bloom"), TensorParallel(0, 2))
    with pytest.raises(GraphDSLError, match="rank=2, world_size=2"):
        TensorParallel(2, 2)
    with pytest.raises(GraphDSLError, match="tensor_parallel_size must be a positive int, got 0"):
        gd.LLM.from_config({}, device="cpu", tensor_parallel_size=0)
    with pytest.raises(GraphDSLError, match=r"quantization='gguf' \(keep a GGUF file's blocks\) is not supported "
                       r"with tensor_parallel_size > 1"):
        gd.LLM.from_config({}, device="cpu", tensor_parallel_size=2, quantization="gguf")


def test_spawned_ranks_need_their_gpus_and_take_them_from_zero(monkeypatch):
    """Refused before anything loads: more ranks than GPUs (the worker on the missing GPU would fail
    while loading, naming an invalid device ordinal), and a device index the ranks would not use."""
    import torch

    from graphdsl.entrypoints import llm as llm_mod
    from graphdsl.runtime.distributed import WorkerPool
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(llm_mod, "check_device", lambda d, what: torch.device(d))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(WorkerPool, "__init__", lambda *a, **kw: pytest.fail("workers started"))
    with pytest.raises(GraphDSLError, match=r"tensor_parallel_size=4 needs 4 GPUs \(rank r runs on cuda:r\), "
                                            r"but this machine has 2"):
        gd.LLM.from_config({}, device="cuda", tensor_parallel_size=4)
    with pytest.raises(GraphDSLError, match=r"device='cuda:1' with tensor_parallel_size=2: the ranks run on "
                                            r"cuda:0..cuda:1 \(rank r on cuda:r\); pass device='cuda'"):
        gd.LLM.from_config({}, device="cuda:1", tensor_parallel_size=2)


def test_spawned_ranks_refuse_a_process_group_still_held(monkeypatch):
    """A group this process still holds (an LLM not closed, or one abandoned after a worker died)
    is refused before anything loads: rank 0 used to join it, waiting for ranks that are not in it."""
    import torch.distributed as dist

    from graphdsl.runtime.distributed import WorkerPool
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(WorkerPool, "__init__", lambda *a, **kw: pytest.fail("workers started"))
    with pytest.raises(GraphDSLError, match=r"tensor_parallel_size=2: this process still holds a torch.distributed "
                                            r"process group \(world size 2\).*llm.close\(\).*start a new process"):
        gd.LLM.from_config({}, device="cpu", tensor_parallel_size=2)


# -- the command line under torchrun (each rank runs `graphdsl generate`; GGUF weights sliced) -------
def _cli(rank: int, world: int, path: str):
    import contextlib
    import io

    from graphdsl.entrypoints.cli import main
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = main(["generate", path, "--prompt", "hello there", "--max-tokens", "6", "--device", "cpu",
                         "--temperature", "0"])
    except SystemExit as e:             # a worker rank leaves once rank 0 is done
        return ("worker", e.code)
    return (code, out.getvalue())


def test_cli_generate_under_torchrun_matches_one_process(tmp_path):
    from tests.models.gguf_tiny import build_tiny_gguf
    path, _ = build_tiny_gguf(tmp_path)
    want = _cli(0, 1, str(path))
    assert want[0] == 0 and want[1].strip()
    assert run_ranks(2, _cli, str(path)) == want


def test_gguf_shards_read_only_their_rows_and_columns(tmp_path):
    """Lazy GGUF reads: q/k (llama.cpp-permuted, Q8_0) by whole heads, F16/Q4_0 rows, columns on block
    boundaries (else whole rows, then sliced): the shard equals the slice of the whole load."""
    from gguf import GGMLQuantizationType as Q

    from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
    from tests.helpers.gguf_files import hf_model_to_gguf
    hf_model = make_checkpoint("llama", tmp_path / "hf", intermediate_size=128)
    path = tmp_path / "q.gguf"
    hf_model_to_gguf(path, hf_model, "llama", quant={r"q_proj|k_proj": Q.Q8_0, r"mlp": Q.Q4_0, r"embed|lm_head|o_proj|v_proj": Q.F16})
    ckpt = GGUFCheckpoint(path)
    config = build_config(ckpt.hf_config())
    cls = resolve_model_class(config.model_type, config.architectures)
    full = load_weights(cls(config, torch.float32), ckpt.iter_tensors(), device="cpu")
    total = sum(int(t.data.nbytes) for t in ckpt._reader.tensors)
    world = 2
    for rank in range(world):
        model = shard_model(cls(config, torch.float32), TensorParallel(rank, world))
        stats = ReadStats()
        shard = load_weights(model, ckpt.iter_tensors_lazy(stats=stats), device="cpu")
        assert stats.bytes < 0.55 * total, (stats.bytes, total)   # about half: norms are whole
        ref = shard_model(cls(config, torch.float32), TensorParallel(rank, world))
        for name, slot in ref.checkpoint_table().items():
            if slot.source:
                src = full_tensor(full, name, config)
                want = src[slot.source]
                got = shard[slot.param][slot.index]
                torch.testing.assert_close(got, want.reshape(got.shape), rtol=0, atol=0, msg=name)


def full_tensor(full: dict, name: str, config) -> torch.Tensor:
    """The whole checkpoint tensor ``name`` out of a single-process load (q/k/v, gate/up unpacked)."""
    h, kv, d, i = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size
    layer, _, leaf = name.rpartition(".")
    parent, _, proj = layer.rpartition(".")
    if proj in ("q_proj", "k_proj", "v_proj"):
        q, k, v = full[f"{parent}.qkv_proj.{leaf}"].split([h * d, kv * d, kv * d])
        return {"q_proj": q, "k_proj": k, "v_proj": v}[proj]
    if proj in ("gate_proj", "up_proj"):
        g, u = full[f"{parent}.gate_up_proj.{leaf}"].split([i, i])
        return g if proj == "gate_proj" else u
    return full[name]


def test_python_dash_m_graphdsl_is_the_cli():
    """What ``torchrun --nproc-per-node N -m graphdsl ...`` runs on every rank."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "graphdsl", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("graphdsl "), out.stderr


def test_expert_parallel_keeps_a_rank_s_experts_and_bounds_top_k():
    m = shard_model(_tiny("qwen2_moe", num_experts=4, num_experts_per_tok=3), TensorParallel(1, 2), expert_parallel=True)
    experts = m.model.layers[0].mlp.experts
    assert (experts.num_experts, experts.first_expert) == (2, 2)
    assert experts.top_k == 2                      # 3 of 4 experts chosen, 2 held here
    assert tuple(experts.gate_up_proj.shape) == (2, 64, 64)
    held = {k: s.held for k, s in m.checkpoint_table().items() if ".experts." in k and k.startswith("model.layers.0.")}
    assert sorted(k for k, h in held.items() if h)[0].startswith("model.layers.0.mlp.experts.2.")
    assert sum(held.values()) == 6 and len(held) == 12


def test_lora_with_tensor_parallel_is_refused(ckpts):
    with gd.LLM(ckpts["odd"], device="cpu", tensor_parallel_size=2, num_kv_blocks=16) as llm:
        with pytest.raises(GraphDSLError, match="LoRA adapters are not supported with tensor_parallel_size > 1"):
            llm.enable_lora()
        assert llm.score(IDS).shape[0] == len(IDS)          # the group still works after the refusal
