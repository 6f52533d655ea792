"""Tensor parallelism on GPUs over NCCL (needs 2 GPUs; NVLink multicast kept off):
``python3 -m pytest -m gpu tests/gpu/test_tensor_parallel_gpu.py`` on an ``nvidia-h200-x2``.

The collectives' NCCL lowerings (triton backend, into the engine's buffers) against their
definitions; whole models (llama, qwen2-MoE, a KV-heads-<-ranks llama) at TP2 against TP1 —
logits and greedy tokens, float32 so the different summation order stays far below the tolerance —
eagerly and with decode CUDA graphs capturing the collectives (``GRAPHDSL_TP_CUDA_GRAPHS=1``), over
NCCL and the one-shot all-reduce (``GRAPHDSL_ALLREDUCE=symm_mem``), each run in a fresh process;
two tensor-parallel LLMs one after the other in one process, on either path;
``close()`` returning once graphs have captured collectives; and a dead worker surfacing as an error
naming its rank, between steps and inside a one-shot step; a killed rank 0 leaving no worker."""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

IDS = [3, 17, 42, 99, 7, 150, 11, 64]
NEW = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.models.hf_tiny import make_checkpoint
    root = tmp_path_factory.mktemp("tp_gpu")
    out = {}
    for name, family, kw in (("llama", "llama", {}), ("qwen2_moe", "qwen2_moe", {}),
                             ("odd", "llama", dict(num_key_value_heads=1, vocab_size=163))):
        make_checkpoint(family, root / name, **kw)
        out[name] = str(root / name)
    return out


def _run_here(path: str, tp: int, kw: dict):
    import graphdsl as gd
    llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=tp, num_kv_blocks=32, **kw)
    try:
        sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        return llm.score(IDS).cpu(), llm.generate([IDS], sp)[0].outputs[0].token_ids
    finally:
        llm.close()


def _run(path: str, tp: int, env: dict | None = None, **kw):
    """Logits of ``IDS`` and greedy tokens at ``tp`` ranks, in a fresh process (``env`` added): a
    process group torn down after graphs captured collectives, or the one-shot path's buffers, must
    not carry over to the next run (docs/distributed.md, "Known problems")."""
    from tests.helpers.tp_ranks import in_fresh_process
    return in_fresh_process(_run_here, path, tp, kw, env=env)


def _nccl_collectives(rank: int, world: int, allreduce: str) -> None:
    os.environ["GRAPHDSL_ALLREDUCE"] = allreduce
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    from graphdsl.runtime.distributed import init_distributed
    ctx = init_distributed(rank, world, torch.device("cuda", rank))
    with Network() as net:
        x = Tensor("x", (Dim("n"), 8 * world), torch.bfloat16)
        net.mark_output(F.all_reduce(x, world_size=world) * 1.0, "ar")
        net.mark_output(F.all_gather(x, dim=-1, world_size=world), "ag")
        net.mark_output(F.all_gather(x, dim=0, world_size=world), "ag0")
        net.mark_output(F.reduce_scatter(x, dim=-1, world_size=world), "rs")
    xs = [torch.arange(5 * 8 * world, dtype=torch.bfloat16, device=ctx.device).reshape(5, -1) * (r + 1) / 64
          for r in range(world)]
    out = net.build_engine(device=ctx.device, backend="triton").forward({"x": xs[rank]})
    total = sum(x.float() for x in xs).to(torch.bfloat16)
    torch.testing.assert_close(out["ar"], total)
    torch.testing.assert_close(out["ag"], torch.cat(xs, -1), rtol=0, atol=0)
    torch.testing.assert_close(out["ag0"], torch.cat(xs, 0), rtol=0, atol=0)
    torch.testing.assert_close(out["rs"], total.chunk(world, -1)[rank])


@pytest.mark.parametrize("allreduce", ["nccl", "symm_mem"])
def test_nccl_collective_lowerings(allreduce):
    from tests.helpers.tp_ranks import run_ranks
    run_ranks(2, _nccl_collectives, allreduce)


@pytest.mark.parametrize("name, kw", [("llama", {}), ("qwen2_moe", {}), ("qwen2_moe", {"expert_parallel": True}),
                                      ("odd", {})])
def test_tp2_matches_tp1(ckpts, name, kw):
    logits, tokens = _run(ckpts[name], 1)
    got_logits, got_tokens = _run(ckpts[name], 2, **kw)
    torch.testing.assert_close(got_logits, logits, rtol=1e-3, atol=1e-3)
    assert got_tokens == tokens


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_tp2_quantized_expert_stacks_match_tp1(ckpts, expert_parallel):
    """int8 expert stacks on two GPUs (the quantized grouped kernels after the split) against one
    GPU. Each rank quantizes its own shards, and a row-parallel linear's per-row scales then cover
    its half of the inputs: tensor parallel's down stack, and with either split the attention's o
    projection and every other row-parallel linear (expert parallel holds the routed experts
    whole, not the rest). So the logits agree within int8's rounding, not to float32's (an H200 pair, session
    45: expert parallel 0.035 at most against logits up to 4.1)."""
    logits, _ = _run(ckpts["qwen2_moe"], 1, quantization="int8")
    got, _ = _run(ckpts["qwen2_moe"], 2, quantization="int8", expert_parallel=expert_parallel)
    torch.testing.assert_close(got, logits, rtol=2e-2, atol=2e-2 * logits.abs().max().item())


def _torchrun_rank(rank: int, world: int, path: str):
    import graphdsl as gd
    try:
        llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=world, num_kv_blocks=32)
    except SystemExit:                    # a worker rank, done once rank 0 closed its LLM
        return None
    sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    out = (llm.score(IDS).cpu(), llm.generate([IDS], sp)[0].outputs[0].token_ids, str(llm.device))
    llm.close()
    return out


def test_torchrun_ranks_on_their_local_gpus(ckpts):
    from tests.helpers.tp_ranks import run_ranks
    logits, tokens = _run(ckpts["odd"], 1)
    got_logits, got_tokens, device = run_ranks(2, _torchrun_rank, ckpts["odd"])
    assert device == "cuda:0" and got_tokens == tokens
    torch.testing.assert_close(got_logits, logits, rtol=1e-3, atol=1e-3)


def test_tp2_decode_cuda_graphs_capture_the_collectives(ckpts):
    logits, tokens = _run(ckpts["llama"], 1)
    got_logits, got_tokens = _run(ckpts["llama"], 2, env={"GRAPHDSL_TP_CUDA_GRAPHS": "1"})
    torch.testing.assert_close(got_logits, logits, rtol=1e-3, atol=1e-3)
    assert got_tokens == tokens


def test_tp2_one_shot_allreduce_matches_tp1(ckpts):
    logits, tokens = _run(ckpts["llama"], 1)
    for graphs in ("0", "1"):
        got_logits, got_tokens = _run(ckpts["llama"], 2, env={"GRAPHDSL_ALLREDUCE": "symm_mem",
                                                               "GRAPHDSL_TP_CUDA_GRAPHS": graphs})
        torch.testing.assert_close(got_logits, logits, rtol=1e-3, atol=1e-3)
        assert got_tokens == tokens, graphs


def _carried_here(path: str, quantization=None):
    """bf16 TP2 logits, greedy tokens and rank 0's carried calls (``calls`` of its carry buffers)."""
    import graphdsl as gd
    from graphdsl.runtime.distributed import collectives
    llm = gd.LLM(path, device="cuda", dtype="bfloat16", tensor_parallel_size=2, num_kv_blocks=32,
                 quantization=quantization)
    try:
        sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        logits, tokens = llm.score(IDS).cpu(), llm.generate([IDS], sp)[0].outputs[0].token_ids
        calls = [b.calls.tolist() for b in collectives._CARRY_BUFFERS.values() if b is not None]
        return logits, tokens, calls
    finally:
        llm.close()


@pytest.mark.parametrize("graphs, quantization", [("0", None), ("1", None), ("1", "int8")])
def test_tp2_carried_allreduce_equals_the_one_shot_path(ckpts, graphs, quantization):
    """GRAPHDSL_TP_CARRY=1: the all-reduce, residual add and norm done by the GEMVs around them give
    what the one-shot launch gives (bf16, so the decode GEMVs run; the norm's sum of squares may add
    in another order), with its calls counted on the device (the prompt's rows run as before),
    eagerly and replayed from graphs; also with int8 weights (``quant_linear`` on both sides)."""
    from tests.helpers.tp_ranks import in_fresh_process
    env = dict(GRAPHDSL_TP_CUDA_GRAPHS=graphs, GRAPHDSL_ALLREDUCE="symm_mem")
    want = in_fresh_process(_carried_here, ckpts["llama"], quantization, env=dict(env, GRAPHDSL_TP_CARRY="0"))
    got = in_fresh_process(_carried_here, ckpts["llama"], quantization, env=dict(env, GRAPHDSL_TP_CARRY="1"))
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    assert got[1] == want[1]
    assert want[2] == [] and len(got[2]) == 1 and got[2][0][0] == got[2][0][1] > 0, got[2]


def _close_seconds_after_graphs(path: str) -> float:
    import time
    import warnings
    import graphdsl as gd
    llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
    llm.generate([IDS], gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    procs = list(llm._tp.pool.procs)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)       # an abandoned teardown warns: fail on it
        llm.close()
    import torch.distributed as dist
    seconds = time.monotonic() - t0
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs) and not dist.is_initialized(), \
        f"workers' exit codes {codes} (0 each expected), group still initialised: {dist.is_initialized()}, " \
        f"{seconds:.1f}s"
    return seconds


def test_close_after_graphs_captured_collectives_returns(ckpts):
    """NCCL's teardown waits for every graph that captured the communicator to be destroyed: before
    the ranks dropped their graphs first, close() never returned (two H200s)."""
    from tests.helpers.tp_ranks import in_fresh_process
    seconds = in_fresh_process(_close_seconds_after_graphs, ckpts["llama"], env={"GRAPHDSL_TP_CUDA_GRAPHS": "1"})
    assert seconds < 20


def _dead_worker_error(path: str) -> str:
    import graphdsl as gd
    from graphdsl.errors import GraphDSLError
    llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        llm.score(IDS)
        w = llm._tp.pool.procs[0]
        w.kill()
        w.join(10)
        try:
            llm.score(IDS)
        except GraphDSLError as e:
            return str(e)
        return "no error"
    finally:
        llm.close()


@pytest.mark.parametrize("allreduce", ["nccl", "symm_mem"])
def test_dead_worker_is_an_error_naming_its_rank(ckpts, allreduce):
    """Also with the one-shot all-reduce, whose kernel waits on the peer's flags: the dead worker is
    found before a step is launched, so no rank spins on a flag that never comes."""
    from tests.helpers.tp_ranks import in_fresh_process
    said = in_fresh_process(_dead_worker_error, ckpts["llama"], env={"GRAPHDSL_ALLREDUCE": allreduce}, timeout_s=150)
    assert "worker rank 1 died" in said


def _worker_dies_inside_a_step(path: str) -> tuple[str, float]:
    """Greedy decode at TP2; the worker is killed the moment rank 0 has announced the third graph
    step, before rank 0 replays its own graph: whatever part of the step the worker had reached,
    rank 0 must not wait for it for good (a one-shot all-reduce spinning on its flags is released
    by rank 0's watch, :meth:`Driver._break`)."""
    import os
    import signal
    import time

    import graphdsl as gd
    from graphdsl.entrypoints import tp_driver
    from graphdsl.errors import GraphDSLError
    llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
    pid = llm._tp.pool.procs[0].pid
    calls = []

    def replay(self, n):
        calls.append(n)
        kill = len(calls) == 3
        return self.driver.announced(lambda ch: ch.send_graph(self.rows, self.width, self._packed),
                                     lambda: (kill and os.kill(pid, signal.SIGKILL), self.local.replay(n))[1])
    tp_driver.TPDecodeGraph.replay = replay
    start = time.monotonic()
    try:
        llm.generate([IDS], gd.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        said = "no error"
    except GraphDSLError as e:
        said = str(e)
    finally:
        llm.close()
    return said, time.monotonic() - start


@pytest.mark.parametrize("allreduce", ["symm_mem", "nccl"])
def test_a_worker_dying_inside_a_step_is_an_error_not_a_hang(ckpts, allreduce):
    """The step ends, its tokens are dropped, and the error names the worker, well before NCCL's
    own timeout."""
    from tests.helpers.tp_ranks import in_fresh_process
    said, seconds = in_fresh_process(_worker_dies_inside_a_step, ckpts["llama"], timeout_s=150,
                                     env={"GRAPHDSL_ALLREDUCE": allreduce, "GRAPHDSL_TP_CUDA_GRAPHS": "1"})
    assert "worker rank 1 died" in said
    assert seconds < 60


_MIXED = [([3, 17, 42, 99, 7, 150, 11, 64], dict(max_tokens=40, temperature=0.0)),
          ([5, 9, 120, 31], dict(max_tokens=12, temperature=0.0)),
          ([8, 8, 61, 2, 90, 14], dict(max_tokens=33, temperature=0.8, top_k=20, seed=5)),
          ([77], dict(max_tokens=25, temperature=0.0))]


def _loop_graph_tokens(path: str, tp: int):
    """Greedy and seeded tokens of four requests of different lengths (rows leave the batch, block
    tables grow past their first block), and how many decode steps rank 0 replayed as
    tensor-parallel graphs."""
    import graphdsl as gd
    from graphdsl.entrypoints import tp_driver
    replays = []
    original = tp_driver.TPDecodeGraph.replay

    def counted(self, n):
        replays.append(n)
        return original(self, n)
    tp_driver.TPDecodeGraph.replay = counted
    llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=tp, num_kv_blocks=64)
    try:
        outs = llm.generate([p for p, _ in _MIXED], [gd.SamplingParams(ignore_eos=True, **kw) for _, kw in _MIXED])
        return [list(o.outputs[0].token_ids) for o in outs], len(replays)
    finally:
        llm.close()


@pytest.mark.parametrize("allreduce", ["nccl", "symm_mem"])
def test_tp2_serving_loop_replays_decode_graphs_on_every_rank(ckpts, allreduce):
    """With decode graphs on, the serving loop replays rank 0's graph and the workers replay theirs
    over the static inputs rank 0 sends each step: new rows, grown block tables and sampled tokens
    reach them, so every request's tokens equal TP1's."""
    from tests.helpers.tp_ranks import in_fresh_process
    tokens, _ = in_fresh_process(_loop_graph_tokens, ckpts["llama"], 1)
    got, replays = in_fresh_process(_loop_graph_tokens, ckpts["llama"], 2,
                                    env={"GRAPHDSL_TP_CUDA_GRAPHS": "1", "GRAPHDSL_ALLREDUCE": allreduce})
    assert got == tokens
    assert replays >= 39                  # every decode step of the longest request went through a graph


def _two_llms_one_after_the_other(path: str):
    import graphdsl as gd
    sp = gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    tokens = []
    for _ in range(2):
        llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
        try:
            tokens.append(list(llm.generate([IDS], sp)[0].outputs[0].token_ids))
        finally:
            llm.close()
    return tokens


@pytest.mark.parametrize("allreduce", ["nccl", "symm_mem"])
def test_a_second_tp_llm_in_one_process_after_close(ckpts, allreduce):
    """A tensor-parallel LLM closed, then another in the same process (decode graphs on): the first
    one's teardown leaves nothing the second one waits on. With the one-shot all-reduce the second
    group maps its own buffers: over torch's symmetric memory it hung in the rendezvous (rank 0's
    process-wide rendezvous state against the fresh workers'), now the handles are exchanged anew."""
    from tests.helpers.tp_ranks import in_fresh_process
    _, tokens = _run(ckpts["llama"], 1)
    first, second = in_fresh_process(_two_llms_one_after_the_other, ckpts["llama"], timeout_s=150,
                                     env={"GRAPHDSL_ALLREDUCE": allreduce})
    assert first == second == list(tokens)


def _serve_until_killed(path: str, pids) -> None:
    """Rank 0 of a TP2 LLM: say the worker's pid, then decode until the test kills this process."""
    import graphdsl as gd
    llm = gd.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
    sp = gd.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate([IDS], sp)
    pids.put(llm._tp.pool.procs[0].pid)
    while True:
        llm.generate([IDS], sp)


def test_a_worker_exits_when_its_rank_0_is_killed(ckpts):
    """A rank 0 killed mid-decode (SIGKILL, the OOM killer) must not leave its worker holding GPU 1
    until NCCL's timeout: the worker sees its parent gone and exits (``workers.exit_with_parent``)."""
    from tests.helpers.tp_ranks import worker_outlives_killed_rank0
    assert not worker_outlives_killed_rank0(_serve_until_killed, (ckpts["llama"],), ready_s=150, gone_within_s=20)
