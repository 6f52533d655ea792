"""Engine: the seed's matmul, forward validation (every error names tensor/expected/actual),
outputs given or returned, weights bound once, runtime params, one plan per shape signature."""
import pytest
import torch

from graphdsl import BindError, Dim, GraphDSLError, Network, RuntimeParam, Tensor, get_default_net
from graphdsl import functional as F
from graphdsl.opdef import OpCategory, register_op


def test_seed_matmul_matches_torch():
    out = F.linear(Tensor("x"), Tensor("weight"), None, False, False)
    get_default_net().mark_output(out, "out")
    engine = get_default_net().build_engine()
    x = torch.rand(100, 200).to(torch.float16)
    weight = torch.rand(200, 300).to(torch.float16)
    buf = torch.empty(100, 300).to(torch.float16)
    res = engine.forward({"x": x, "weight": weight}, {"out": buf})
    assert res["out"] is buf
    assert torch.allclose(torch.matmul(x, weight), buf, rtol=1e-2, atol=1e-2)


def _mlp_engine():
    n = Dim("n", max=16)
    with Network("mlp") as net:
        x = Tensor("x", (n, 8), torch.float32)
        w = Tensor("w", (8, 4), torch.float32)
        y = F.relu(F.linear(x, w)) * 2.0
        net.mark_output(y, "y")
    return net.build_engine()


def test_outputs_returned_when_omitted_and_one_plan_per_signature():
    eng = _mlp_engine()
    w = torch.randn(8, 4)
    eng.set_weights({"w": w})
    for n in (3, 5, 3):
        x = torch.randn(n, 8)
        torch.testing.assert_close(eng.forward({"x": x})["y"], torch.relu(x @ w) * 2)
    assert len(eng._plans) == 2
    assert "[n=3]" in eng.summary() and "[n=5]" in eng.summary()


def test_output_buffers_only_for_a_shape_that_ran():
    """What a CUDA-graph runner takes instead of one more eager run before a capture: new buffers
    of a plan that ran for real, None for a shape not run yet (its capture must warm it up)."""
    eng = _mlp_engine()
    eng.set_weights({"w": torch.randn(8, 4)})
    assert eng.output_buffers({"x": torch.randn(3, 8)}) is None
    ran = eng.forward({"x": torch.randn(3, 8)})["y"]
    bufs = eng.output_buffers({"x": torch.randn(3, 8)})
    assert list(bufs) == ["y"] and bufs["y"].shape == ran.shape and bufs["y"].dtype == ran.dtype
    assert bufs["y"].data_ptr() != ran.data_ptr()
    assert eng.output_buffers({"x": torch.randn(5, 8)}) is None       # another shape: no plan yet
    assert eng.output_buffers({}) is None                             # x missing


def test_inputs_override_bound_weights():
    eng = _mlp_engine()
    eng.set_weights({"w": torch.zeros(8, 4)})
    x, w = torch.randn(2, 8), torch.randn(8, 4)
    torch.testing.assert_close(eng.forward({"x": x, "w": w})["y"], torch.relu(x @ w) * 2)


@pytest.mark.parametrize("feed,outs,msg", [
    ({"x": torch.randn(2, 8), "w": torch.randn(8, 4), "z": torch.ones(1)}, None, r"unknown inputs \['z'\]; the graph's inputs are \['x', 'w'\]"),
    ({"x": torch.randn(2, 8)}, None, r"missing inputs \['w'\]"),
    ({"x": [1, 2], "w": torch.randn(8, 4)}, None, r"input 'x' must be a torch.Tensor, got list"),
    ({"x": torch.randn(2, 8, dtype=torch.float64), "w": torch.randn(8, 4)}, None, r"input 'x': expected dtype float32, got float64"),
    ({"x": torch.randn(2, 7), "w": torch.randn(8, 4)}, None, r"input 'x': expected shape \[n, 8\], got \[2, 7\]"),
    ({"x": torch.randn(17, 8), "w": torch.randn(8, 4)}, None, r"dim 0 \('n'\) is 17, above its max 16"),
    ({"x": torch.randn(2, 8), "w": torch.randn(8, 4)}, {"y": torch.empty(2, 5)}, r"output 'y': expected \[2, 4\] float32 on cpu, got \[2, 5\] float32 on cpu"),
    ({"x": torch.randn(2, 8), "w": torch.randn(8, 4)}, {"q": torch.empty(2, 4)}, r"unknown outputs \['q'\]"),
    ({"x": torch.randn(2, 8), "w": torch.randn(8, 4, device="meta")}, None, r"input 'w' is on meta, but 'x' is on cpu"),
])
def test_forward_errors(feed, outs, msg):
    with pytest.raises(BindError, match=msg):
        _mlp_engine().forward(feed, outs)


def test_set_weights_errors():
    eng = _mlp_engine()
    with pytest.raises(BindError, match=r"set_weights: unknown names \['v'\]"):
        eng.set_weights({"v": torch.ones(1)})
    with pytest.raises(BindError, match=r"weight 'w': expected shape \[8, 4\], got \[4, 8\]"):
        eng.set_weights({"w": torch.ones(4, 8)})
    with pytest.raises(BindError, match=r"^weight 'w': expected dtype float32, got float64$"):    # not "input"
        eng.set_weights({"w": torch.ones(8, 4, dtype=torch.float64)})
    with pytest.raises(BindError, match=r"^weight 'w' must be a torch.Tensor, got list$"):
        eng.set_weights({"w": [1.0]})


def test_summary_of_shape_less_inputs_shows_the_call():
    with Network("seed") as net:
        net.mark_output(F.matmul(Tensor("a"), Tensor("b")), "c")
    eng = net.build_engine()
    assert "a (shape and dtype from the first call)" in eng.summary()
    assert "[?]" not in eng.summary()
    eng.forward({"a": torch.ones(2, 3), "b": torch.ones(3, 4)})
    text = eng.summary()
    assert "a [2, 3] float32 (last call), b [3, 4] float32 (last call)" in text
    assert "c [2, 4] float32 (last call)" in text and "[a=[2, 3], b=[3, 4]] arena" in text


def test_pinned_device_is_checked():
    n = Dim("n")
    with Network() as net:
        net.mark_output(F.exp(Tensor("x", (n,), "float32")), "y")
    eng = net.build_engine(device="cpu")   # pinned devices are cpu/cuda; a meta tensor stands for another one
    with pytest.raises(BindError, match="input 'x' is on meta, but the engine's device cpu"):
        eng.forward({"x": torch.ones(3, device="meta")})


def test_unspecialised_graph_reports_shape_errors_at_the_call():
    with Network() as net:
        net.mark_output(F.matmul(Tensor("a"), Tensor("b")), "c")
    eng = net.build_engine()
    torch.testing.assert_close(eng.forward({"a": torch.ones(2, 3), "b": torch.ones(3, 4)})["c"], torch.full((2, 4), 3.0))
    with pytest.raises(BindError, match=r"node 'matmul_0' \(matmul at .*test_engine.py:\d+\) rejects this call's shapes .*inner dims differ"):
        eng.forward({"a": torch.ones(2, 3), "b": torch.ones(5, 4)})


def test_build_errors():
    with Network() as net:
        F.exp(Tensor("x", (2,), "float32"))
    with pytest.raises(GraphDSLError, match="has no outputs"):
        net.build_engine()
    net.mark_output(net.nodes[0].outputs[0], "y")
    with pytest.raises(GraphDSLError, match=r"unknown backend 'cuda-magic'; available: \['torch'"):
        net.build_engine(backend="cuda-magic")


def test_runtime_params_resolve_attributes():
    @register_op("test_scale_by", category=OpCategory.POINTWISE, shape=lambda x, **_: x)
    def scale_by(x, *, factor=1.0):
        """x * factor"""
        return x * factor

    with Network() as net:
        net.mark_output(scale_by(Tensor("x", (3,), "float32"), factor=RuntimeParam("factor")), "y")
    eng = net.build_engine()
    x = torch.randn(3)
    torch.testing.assert_close(eng.forward({"x": x}, runtime_params={"factor": 3.0})["y"], 3 * x)
    torch.testing.assert_close(eng.forward({"x": x}, runtime_params={"factor": -1.0})["y"], -x)
    with pytest.raises(BindError, match=r"missing runtime_params \['factor'\]"):
        eng.forward({"x": x})
    with pytest.raises(BindError, match=r"unknown runtime_params \['other'\]; this graph takes \['factor'\]"):
        eng.forward({"x": x}, runtime_params={"factor": 1.0, "other": 2})


def test_dead_code_is_removed_and_cache_writes_kept():
    with Network() as net:
        x = Tensor("x", (4, 2, 8), "float32")
        kc, vc = Tensor("kc", (2, 4, 2, 8), "float32"), Tensor("vc", (2, 4, 2, 8), "float32")
        F.exp(x)                                     # dead
        F.reshape_and_cache(x, x, kc, vc, Tensor("slots", (4,), torch.int64))   # side effect, unused result
        net.mark_output(F.neg(x), "y")
    eng = net.build_engine()
    assert [n.op for n in eng.net.nodes] == ["reshape_and_cache", "neg"]
    k, v = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    xs = torch.randn(4, 2, 8)
    eng.forward({"x": xs, "kc": k, "vc": v, "slots": torch.tensor([5, 0, -1, 2])})
    torch.testing.assert_close(k.view(8, 2, 8)[[5, 0, 2]], xs[[0, 1, 3]])
    assert k.view(8, 2, 8)[[1, 3, 4, 6, 7]].abs().sum() == 0


def test_output_that_is_a_view_or_an_input():
    with Network() as net:
        x = Tensor("x", (2, 3), "float32")
        net.mark_output(F.exp(x).reshape(3, 2), "v")
        net.mark_output(x, "same")
    x = torch.randn(2, 3)
    out = net.build_engine().forward({"x": x})
    torch.testing.assert_close(out["v"], x.exp().reshape(3, 2))
    torch.testing.assert_close(out["same"], x)
    assert out["same"].data_ptr() != x.data_ptr()


def test_reference_that_breaks_its_shape_rule_is_caught():
    @register_op("test_liar", category=OpCategory.POINTWISE, shape=lambda x, **_: x)
    def liar(x):
        """claims same shape, returns a float64 result"""
        return x.double() * 2

    with Network() as net:
        net.mark_output(F.exp(liar(Tensor("x", (3,), "float32"))), "y")
    with pytest.raises(GraphDSLError, match=r"node '\w+' \(\w+ at .*test_engine.py:\d+\): the op's torch reference returned \[3\] torch.float64 but its shape rule promised \[3\] torch.float32"):
        net.build_engine().forward({"x": torch.ones(3)})


def test_cast_to_a_tensor_whose_dtype_is_known_only_at_run_time():
    import graphdsl as gd
    w = gd.Parameter((4, 3), name="w")                       # dtype adopted from the bound weight
    with Network() as net:
        x = Tensor("x", (2, 4), "float32")
        y = F.matmul(x.to(w), w)                              # cast_like: w's dtype is unknown here
        net.mark_output(y, "y")
    assert [n.op for n in net.nodes] == ["cast_like", "matmul"]
    eng = net.build_engine()
    wt = torch.randn(4, 3, dtype=torch.float64)
    xs = torch.randn(2, 4)
    out = eng.forward({"x": xs, "w": wt})["y"]
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, xs.double() @ wt)
    with pytest.raises(GraphDSLError, match=r"cast: dtype must be a torch dtype .* got None; .* pass the tensor: x.to\(y\)"):
        with Network():
            Tensor("x", (2,), "float32").to(None)


def test_dtype_less_parameters_build_and_run():
    """Layers whose Parameters carry no dtype (bound weights decide) build through every pass."""
    from graphdsl.layers import ColumnParallelLinear, MoE
    for layer in (ColumnParallelLinear(16, 8, bias=True),
                  MoE(16, 4, 2, 8, shared_intermediate_size=8, shared_expert_gate=True)):
        with Network() as net:
            net.mark_output(layer(Tensor("x", (3, 16), "float32")), "y")
        eng = net.build_engine()
        eng.set_weights({n: torch.randn(p.shape) for n, p in layer.named_parameters()})
        assert torch.isfinite(eng.forward({"x": torch.randn(3, 16)})["y"]).all()


def test_arena_id_changes_only_when_a_larger_plan_regrows_the_arena():
    """``arena_id`` is 0 before any call, stays while plans fit the arena, changes when one does not
    (what a captured CUDA graph holding the old arena's views checks)."""
    n = Dim("n")
    with Network() as net:
        h = F.matmul(Tensor("x", (n, 8), "float32"), Tensor("w", (8, 8), "float32"))
        net.mark_output(F.matmul(h, Tensor("v", (8, 8), "float32")), "y")   # h lives in the arena
    eng = net.build_engine(device="cpu")
    eye = torch.eye(8)
    assert eng.arena_id("cpu") == 0
    eng.forward({"x": torch.ones(64, 8), "w": eye, "v": eye})
    first = eng.arena_id("cpu")
    assert first != 0
    eng.forward({"x": torch.ones(8, 8), "w": eye, "v": eye})     # a smaller plan fits the same arena
    assert eng.arena_id("cpu") == first
    x = torch.randn(4096, 8)
    y = eng.forward({"x": x, "w": eye, "v": 2 * eye})["y"]       # a larger one regrows it
    assert eng.arena_id("cpu") != first
    torch.testing.assert_close(y, 2 * x)
    assert eng.arena_id(torch.device("cpu", 0)) == eng.arena_id("cpu")   # one device however it is named


def test_a_forward_inside_a_dry_pass_zeroes_the_arena_first(monkeypatch):
    """A graph runner's dry pass (runtime/precompile.py) skips Triton launches, so its ops would read
    whatever an earlier step left in the arena; the engine zeroes it first — only then."""
    from graphdsl.runtime import precompile
    pytest.importorskip("triton")
    n = Dim("n")
    with Network() as net:
        h = F.matmul(Tensor("x", (n, 8), "float32"), Tensor("w", (8, 8), "float32"))
        net.mark_output(F.matmul(h, Tensor("v", (8, 8), "float32")), "y")   # h lives in the arena
    eng = net.build_engine(device="cpu")
    feed = {"x": torch.ones(4, 8), "w": torch.eye(8), "v": torch.eye(8)}
    eng.forward(feed)
    arena = eng._arenas[torch.device("cpu")]
    seen = []
    run = eng.backend.run
    monkeypatch.setattr(eng.backend, "run", lambda *a, **k: (seen.append(arena.clone()), run(*a, **k))[1])
    arena.fill_(7)
    eng.forward(feed)                                        # a plain forward leaves the arena alone
    with precompile.defer_launches():                         # a dry pass on this thread
        eng.forward(feed)
    assert bool((seen[0] == 7).all()) and not bool(seen[1].any())


def test_a_new_plans_watched_run_that_went_dry_runs_again(monkeypatch):
    """Engine._run's contract with precompile.run_ahead: a new plan's first run goes through it; when
    it reports (the run turned dry: its results are garbage) the backend runs again on fresh values,
    and those are the outputs; when it ran through, its values are the outputs; a known plan runs once."""
    from graphdsl.runtime import precompile
    n = Dim("n")
    with Network() as net:
        h = F.matmul(Tensor("x", (n, 8), "float32"), Tensor("w", (8, 8), "float32"))
        net.mark_output(F.matmul(h, Tensor("v", (8, 8), "float32")), "y")
    eng = net.build_engine(device="cpu")
    runs, watched = [], []
    real_run = eng.backend.run

    def run(nodes, values, attrs, storage, after=None):
        runs.append(values)
        real_run(nodes, values, attrs, storage, after=after)
        if watched and watched[-1] == "dry" and len(runs) == 1:
            for t in list(values):                   # a dry part leaves garbage behind
                if values[t].dtype.is_floating_point and t.producer is not None:
                    values[t] = torch.full_like(values[t], float("nan"))
    monkeypatch.setattr(eng.backend, "run", run)
    monkeypatch.setattr(eng.backend, "ahead_applies", lambda nodes, device: True, raising=False)
    turns = iter(["dry", "through"])

    def run_ahead(forward, label, on_dry=None):
        watched.append(next(turns))
        assert callable(on_dry)                      # the arena's zeroing, for the turn
        forward()
        return object() if watched[-1] == "dry" else None
    monkeypatch.setattr(precompile, "run_ahead", run_ahead)
    x, eye = torch.randn(4, 8), torch.eye(8)
    y = eng.forward({"x": x, "w": eye, "v": 2 * eye})["y"]
    assert len(runs) == 2 and runs[0] is not runs[1]            # ran again, on fresh values
    torch.testing.assert_close(y, 2 * x)
    y = eng.forward({"x": x[:3], "w": eye, "v": 3 * eye})["y"]    # a new plan that ran through
    assert len(runs) == 3 and watched == ["dry", "through"]
    torch.testing.assert_close(y, 3 * x[:3])
    eng.forward({"x": x, "w": eye, "v": eye})                    # a known plan: one plain run
    assert len(runs) == 4 and len(watched) == 2


def test_a_plan_first_run_inside_a_dry_pass_is_watched_until_it_runs_for_real(monkeypatch):
    """A warm-up's watch that turned dry (runtime/precompile.py) makes plans whose runs launched
    nothing: the plan's next run, outside the dry pass, is watched again (its kernels may still be
    missing), and only once that run finished is the plan run plainly."""
    from graphdsl.runtime import precompile
    pytest.importorskip("triton")
    n = Dim("n")
    with Network() as net:
        net.mark_output(F.matmul(Tensor("x", (n, 8), "float32"), Tensor("w", (8, 8), "float32")), "y")
    eng = net.build_engine(device="cpu")
    monkeypatch.setattr(eng.backend, "ahead_applies", lambda nodes, device: True, raising=False)
    watched = []

    def run_ahead(forward, label, on_dry=None):
        watched.append(precompile.dry_pass_running())
        forward()
    monkeypatch.setattr(precompile, "run_ahead", run_ahead)
    feed = {"x": torch.ones(4, 8), "w": torch.eye(8)}
    with precompile.defer_launches():                          # a dry pass on this thread
        eng.forward(feed)
    assert watched == [True]
    eng.forward(feed)                                          # the plan's first real run: watched
    assert watched == [True, False]
    torch.testing.assert_close(eng.forward(feed)["y"], torch.ones(4, 8))   # then plain
    assert watched == [True, False]
