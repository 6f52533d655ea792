"""Generated fused kernels and the Triton backend vs the torch reference.

On CPU the kernels run under ``TRITON_INTERPRET=1`` with small shapes (set before any kernel is
defined); on a GPU they run compiled. The property test draws random pointwise/reduction networks
and random pass subsets: the optimised Triton engine must equal the unoptimised torch engine.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from graphdsl import Dim, Network, Tensor  # noqa: E402
from graphdsl import functional as F  # noqa: E402
from graphdsl.errors import GraphDSLError  # noqa: E402
from graphdsl.functional.attention import RopeLayout  # noqa: E402
from graphdsl.opdef import get_op  # noqa: E402
from graphdsl.passes import pass_names  # noqa: E402
from graphdsl.runtime.codegen import launch_config, run_fused  # noqa: E402
from graphdsl.runtime.codegen.ops import add_rms_norm, rope_cache, silu_mul  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
import tiny_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter rounds float32 -> bfloat16 toward zero (the GPU rounds to nearest even): 1 ulp
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 40), (3, 2, 33)])
def test_add_rms_norm_kernel(dtype, shape):
    x, r = (torch.randn(shape, device=DEV).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV)).to(dtype)
    out = torch.full_like(x, float("nan"))
    res = torch.full_like(x, float("nan"))
    add_rms_norm(x, r, w, eps=1e-5, out=out, residual_out=res)
    want_out, want_res = get_op("add_rms_norm").reference(x, r, w, eps=1e-5)
    close(res, want_res, dtype)
    close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_reads_halves_in_place(dtype):
    x = torch.randn(6, 2 * 37, device=DEV).to(dtype)
    out = silu_mul(x)
    close(out, get_op("silu_mul").reference(x), dtype)


@pytest.mark.parametrize("layout", list(RopeLayout))
@pytest.mark.parametrize("rot_half", [4, 3])
def test_rope_cache_kernel(layout, rot_half):
    T, HQ, HK, D = 7, 4, 2, 8
    q, k, v = torch.randn(T, HQ, D, device=DEV), torch.randn(T, HK, D, device=DEV), torch.randn(T, HK, D, device=DEV)
    kc, vc = torch.randn(4, 4, HK, D, device=DEV), torch.randn(4, 4, HK, D, device=DEV)
    cos, sin = torch.randn(T, rot_half, device=DEV), torch.randn(T, rot_half, device=DEV)
    slots = torch.tensor([0, 5, -1, 15, 2, 9, 3], device=DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    want = get_op("rope_cache").reference(q, k, v, kc2, vc2, cos, sin, slots, layout=layout)
    got = rope_cache(q, k, v, kc, vc, cos, sin, slots, layout=layout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_rope_cache_rejects_non_contiguous_cache():
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    kc = torch.randn(2, 2, 1, 16)[..., :8]
    with pytest.raises(GraphDSLError, match="key_cache must be contiguous"):
        rope_cache(q, k, v, kc, torch.randn(2, 2, 1, 8), torch.randn(2, 4), torch.randn(2, 4), torch.tensor([0, 1]))


@pytest.mark.parametrize("op,ref", [
    ("sum", lambda x: x.exp().sum(-1)), ("mean", lambda x: x.exp().mean(-1)), ("max", lambda x: x.exp().amax(-1))])
def test_row_reductions_store_one_value_per_row(op, ref):
    x = torch.randn(4, 3, 21, device=DEV)
    out = torch.full((4, 3), float("nan"), device=DEV)
    run_fused((("exp", (0,), ()), (op, (1,), (("dim", -1), ("keepdim", False)))), (2,), [x], [out])
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)


def test_broadcast_and_strided_operands():
    base = torch.randn(8, 10, device=DEV)
    x = base.t()                                  # [10, 8] non-contiguous
    col = torch.randn(10, 1, device=DEV)          # broadcast over columns
    out = torch.empty(10, 8, device=DEV)
    run_fused((("mul", (0, 1), ()), ("sigmoid", (2,), ())), (3,), [x, col], [out])
    torch.testing.assert_close(out, torch.sigmoid(x * col))


def test_launch_config_is_shared_and_bounded():
    assert launch_config(4096, reduction=True) == (4096, 8)
    assert launch_config(14336, reduction=False) == (1024, 4)
    with pytest.raises(GraphDSLError, match="exceeds the supported maximum"):
        launch_config(70000, reduction=True)


def test_generated_source_is_cached_and_dumped(tmp_path):
    with Network("p") as net:
        x = Tensor("x", (Dim("n"), 16), torch.float32)
        net.mark_output(F.softmax(F.exp(x) * 0.5, -1), "y")
    eng = net.build_engine(backend="triton")
    x = torch.randn(3, 16, device=DEV)
    torch.testing.assert_close(eng.forward({"x": x})["y"], torch.softmax(x.exp() * 0.5, -1))
    eng.dump(tmp_path)
    (src,) = list((tmp_path / "kernels").iterdir())
    text = src.read_text()
    assert "@triton.jit" in text and "softmax(%" in text and "tl.exp" in text


# -- the tiny transformer block on the Triton backend -----------------------------------------
def test_tiny_block_triton_engine_matches_reference_with_fewer_launches():
    w, feed = tiny_block.weights(2), tiny_block.inputs(9)
    net = tiny_block.build(2)
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="triton")
    eng.set_weights({k: v.to(DEV) for k, v in w.items()})
    got = eng.forward({k: v.clone().to(DEV) for k, v in feed.items()})["logits"].cpu()
    want = ref.forward({**w, **{k: v.clone() for k, v in feed.items()}})["logits"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert eng.num_launches < ref.num_launches
    assert "fused kernels: 8" in eng.summary() and "backend=triton" in eng.summary()


@pytest.mark.parametrize("num_tokens", [3, 20, 64])
def test_tiny_block_fp16_projections_run_as_decode_gemvs(num_tokens, monkeypatch):
    """In fp16 with <= 16 tokens every weight projection runs as the decode GEMV; with 64 tokens
    the gate/up projections run the tiled SwiGLU GEMM (a row count where it beats cuBLAS) and the
    others cuBLAS (torch.matmul); with 20 all go to cuBLAS; all match the unfused torch reference."""
    import graphdsl.runtime.kernels.gemv as gemv_module
    import graphdsl.runtime.kernels.swiglu_gemm as swiglu_module
    calls, swiglu_calls = [], []
    real, real_swiglu = gemv_module.gemv, swiglu_module.swiglu_gemm
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    monkeypatch.setattr(swiglu_module, "swiglu_gemm",
                        lambda *a, **k: swiglu_calls.append(a[1].shape) or real_swiglu(*a, **k))
    dt = torch.float16
    w, feed = tiny_block.weights(2, dtype=dt), tiny_block.inputs(num_tokens, dtype=dt)
    net = tiny_block.build(2, dtype=dt)
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="triton")
    scratch = []                             # is each workspace the engine's arena?
    real_ws = eng.backend.workspace
    monkeypatch.setattr(eng.backend, "workspace", lambda *a: scratch.append(real_ws(*a)) or scratch[-1])
    eng.set_weights({k: v.to(DEV) for k, v in w.items()})
    got = eng.forward({k: v.clone().to(DEV) for k, v in feed.items()})["logits"].cpu().float()
    want = ref.forward({**w, **{k: v.clone() for k, v in feed.items()}})["logits"].float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    matmuls = [n for n in eng.net.nodes if n.op in ("matmul", "matmul_add", "matmul_silu_mul")]
    assert len(calls) == (len(matmuls) if num_tokens <= 16 else 0) and len(matmuls) == 9
    swiglu = [n.name for n in matmuls if n.op == "matmul_silu_mul"]
    assert len(swiglu_calls) == (2 if num_tokens == 64 else 0)
    # the gate/up GEMMs through cuBLAS (20 tokens): the product sits in a planned workspace
    assert len(swiglu) == 2 and sorted(eng.last_plan.memory.workspace_slots) == sorted(swiglu)
    (arena,) = [a.untyped_storage().data_ptr() for a in eng._arenas.values()]
    assert [x.untyped_storage().data_ptr() for x in scratch] == ([arena] * 2 if num_tokens == 20 else [])


# -- property test: random pointwise/reduction networks x random pass subsets -------------------
_UNARY = [F.sigmoid, F.tanh, F.silu, F.neg, F.relu, F.gelu, lambda a: F.exp(F.tanh(a)), lambda a: a * 0.5,
          lambda a: a + 1.0, lambda a: a * a]
_BINARY = [F.add, F.sub, F.mul, lambda a, b: a / (1.0 + F.sigmoid(b)), lambda a, b: F.where(F.gt(a, b), a, b)]
_REDUCE = [None, lambda a, w: F.rms_norm(a, w), lambda a, w: F.softmax(a, -1), lambda a, w: F.sum(a, -1),
           lambda a, w: F.mean(a, -1, keepdim=True), lambda a, w: F.max(a, -1)]


@st.composite
def networks(draw):
    steps = draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 99), st.integers(0, 99), st.integers(0, 99)),
                          min_size=1, max_size=7))
    reduce_kind = draw(st.integers(0, len(_REDUCE) - 1))
    marked = draw(st.sets(st.integers(0, 99), max_size=3))
    subset = draw(st.sets(st.sampled_from(pass_names())))
    rows, cols = draw(st.integers(1, 5)), draw(st.sampled_from([1, 7, 16, 33]))
    return steps, reduce_kind, marked, subset, rows, cols


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(networks())
def test_random_networks_equal_reference_for_every_pass_subset(case):
    steps, reduce_kind, marked, subset, rows, cols = case
    n = Dim("n")
    with Network("rand") as net:
        x, y = Tensor("x", (n, cols), torch.float32), Tensor("y", (cols,), torch.float32)
        z = Tensor("z", (n, 1), torch.float32)
        vals = [x, y, z]
        for kind, a, b, op in steps:
            if kind == 0:
                vals.append(_UNARY[op % len(_UNARY)](vals[a % len(vals)]))
            else:
                vals.append(_BINARY[op % len(_BINARY)](vals[a % len(vals)], vals[b % len(vals)]))
        last = vals[-1]
        red = _REDUCE[reduce_kind]
        if red is not None and last.shape is not None and tuple(last.shape) == (n, cols):
            last = red(last, y)
        net.mark_output(last, "out")
        for i, m in enumerate(sorted(marked)):
            v = vals[3 + m % (len(vals) - 3)] if len(vals) > 3 else x
            if v not in net.outputs.values():
                net.mark_output(v, f"extra{i}")
    feed = {"x": torch.randn(rows, cols), "y": torch.randn(cols), "z": torch.randn(rows, 1)}
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="triton", passes=sorted(subset))
    want = ref.forward({k: v for k, v in feed.items() if k in ref.required})
    got = eng.forward({k: v.to(DEV) for k, v in feed.items() if k in eng.required})
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k], rtol=2e-5, atol=2e-5, equal_nan=True)


def test_dump_dir_gets_kernel_sources_after_the_first_forward(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHDSL_DUMP_DIR", str(tmp_path))
    with Network("dumped") as net:
        x = Tensor("x", (Dim("n"), 8), torch.float32)
        net.mark_output(F.sigmoid(x) * x + 1.0, "y")
    eng = net.build_engine(backend="triton")
    (d,) = list(tmp_path.iterdir())
    assert not (d / "kernels").exists()
    x = torch.randn(2, 8, device=DEV)
    torch.testing.assert_close(eng.forward({"x": x})["y"], torch.sigmoid(x) * x + 1.0)
    (src,) = list((d / "kernels").iterdir())
    assert "def fused_kernel(" in src.read_text()


def test_batched_matmul_silu_mul_keeps_the_broadcast_product_in_its_workspace():
    """MoE experts: x [T, H] times stacked weights [E, 2I, H] broadcasts to [E, T, 2I]; past the
    GEMV the product goes to the node's workspace, shaped by the op's workspace rule."""
    n = Dim("n")
    with Network("experts") as net:
        x = Tensor("x", (n, 16), torch.float32)
        w = Tensor("w", (3, 24, 16), torch.float32)
        net.mark_output(F.activation(F.matmul(x, w, transpose_b=True), F.ActType.SWIGLU), "y")
    eng = net.build_engine(backend="triton")
    assert [nd.op for nd in eng.net.nodes] == ["matmul_silu_mul"]
    x, w = torch.randn(5, 16), torch.randn(3, 24, 16)
    got = eng.forward({"x": x.to(DEV), "w": w.to(DEV)})["y"].cpu()
    p = x @ w.mT
    torch.testing.assert_close(got, torch.nn.functional.silu(p[..., :12]) * p[..., 12:], rtol=1e-5, atol=1e-5)
    ((_, nbytes),) = eng.last_plan.memory.workspace_slots.values()
    assert nbytes == 3 * 5 * 24 * 4


def test_workspace_of_the_wrong_shape_is_an_error():
    """A planned workspace that disagrees with the op's workspace rule is named, not overwritten."""
    from graphdsl.runtime.backends.triton_backend import TritonBackend
    with Network("p") as net:
        x = Tensor("x", (20, 16), torch.float32)
        w = Tensor("w", (24, 16), torch.float32)
        net.mark_output(F.activation(F.matmul(x, w, transpose_b=True), F.ActType.SWIGLU), "y")
    eng = net.build_engine(backend="triton")
    node = eng.net.nodes[0]
    assert node.op == "matmul_silu_mul"
    be = TritonBackend()
    values = {eng.net.inputs["x"]: torch.randn(20, 16).to(DEV), eng.net.inputs["w"]: torch.randn(24, 16).to(DEV)}
    attrs = {node: dict(node.attrs)}
    with pytest.raises(GraphDSLError, match=r"node 'matmul_silu_mul_\d+' \(matmul_silu_mul\): its planned workspace is "
                                            r"\[20, 12\] torch.float32, the op's workspace rule gives \[20, 24\]"):
        be.run([node], values, attrs, {node: torch.empty(20, 12, device=DEV)})


def test_kernel_source_does_not_depend_on_the_row_count():
    """A new token count must reuse the compiled kernel: the generated source names dtypes and
    ranks, never sizes (sizes in the source made every new prefill length compile again)."""
    from graphdsl.runtime.codegen.fused import prepare_fused
    from graphdsl.runtime.codegen.ops import add_rms_norm_program
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sources = set()
    for rows in (200, 201, 17):
        x, r, w = torch.randn(rows, 64, device=dev), torch.randn(rows, 64, device=dev), torch.randn(64, device=dev)
        outs = [torch.empty(rows, 64, device=dev), torch.empty(rows, 64, device=dev)]
        kernel, _ = prepare_fused(add_rms_norm_program(1e-5), (4, 3), [x, r, w], outs)
        sources.add(kernel.source)
    assert len(sources) == 1


@pytest.mark.parametrize("computed_weight", [False, True])
def test_inputs_no_kernel_writes_are_loaded_before_the_pdl_wait(computed_weight):
    """A generated kernel loads the inputs no node of the step writes (the norm weight, a graph
    input) before its PDL wait, so their memory latency overlaps the previous kernel; a value made
    in the step (the matmul's output, a weight scaled in the graph) is loaded after the wait. The
    result is the same either way."""
    n = Dim("n")
    with Network("early_loads") as net:
        a = Tensor("a", (n, 32), torch.float32)
        b = Tensor("b", (64, 32), torch.float32)
        w = Tensor("w", (64,), torch.float32)
        y = F.matmul(a, b, transpose_b=True)
        net.mark_output(F.rms_norm(y, F.sigmoid(w) if computed_weight else w, eps=1e-5), "out")
    eng = net.build_engine(backend="triton")
    feed = {"a": torch.randn(3, 32), "b": torch.randn(64, 32), "w": torch.randn(64)}
    got = eng.forward({k: v.to(DEV) for k, v in feed.items()})["out"].cpu()
    y = feed["a"] @ feed["b"].T
    weight = torch.sigmoid(feed["w"]) if computed_weight else feed["w"]
    torch.testing.assert_close(got, y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * weight,
                               rtol=1e-5, atol=1e-5)
    (src,) = [s for s in eng.backend.sources.values() if "rms_norm" in s]
    before, after = src.split("pdl_wait(USE_PDL)")
    assert after.count("tl.load(") == (2 if computed_weight else 1)     # y (and the computed weight) after
    assert before.count("tl.load(") == (0 if computed_weight else 1)    # the weight before


def test_early_loads_off_puts_every_load_after_the_wait(monkeypatch):
    """``fused._EARLY_LOADS = False`` (an A/B switch) generates every load after the wait."""
    from graphdsl.runtime.codegen import fused
    from graphdsl.runtime.codegen.ops import add_rms_norm_program
    x, r, w = torch.randn(2, 64, device=DEV), torch.randn(2, 64, device=DEV), torch.randn(64, device=DEV)
    outs = [torch.empty(2, 64, device=DEV), torch.empty(2, 64, device=DEV)]
    on, _ = fused.prepare_fused(add_rms_norm_program(1e-5), (4, 3), [x, r, w], outs, early=[2])
    monkeypatch.setattr(fused, "_EARLY_LOADS", False)
    off, _ = fused.prepare_fused(add_rms_norm_program(1e-5), (4, 3), [x, r, w], outs, early=[2])
    assert on.source.split("pdl_wait(USE_PDL)")[0].count("tl.load(") == 1
    assert off.source.split("pdl_wait(USE_PDL)")[0].count("tl.load(") == 0
