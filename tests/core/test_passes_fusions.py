"""The passes one by one (expected program, lint, numbers equal to the unoptimised engine), the
fusion report's near misses, and the tiny transformer block end to end (torch backend, CPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from graphdsl import Dim, Module, Network, Parameter, Tensor
from graphdsl import functional as F
from graphdsl.passes import PassManager, pass_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
import tiny_block  # noqa: E402


def optimise(net: Network, **kw) -> tuple[Network, object]:
    work = Network.from_json(net.to_json())
    report = PassManager(lint=True, **kw).run(work)
    work.lint()
    return work, report


def ops_of(net: Network) -> list[str]:
    return [n.op for n in net.nodes]


def check_numbers(net: Network, feed: dict, tol=1e-5, **build):
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="torch", **build)
    a = ref.forward({k: v.clone() for k, v in feed.items()})
    b = eng.forward({k: v.clone() for k, v in feed.items()})
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=tol, atol=tol)
    return ref, eng


# -- LLM fusions ---------------------------------------------------------------------------------
def test_add_rms_norm_fuses_and_returns_both_values():
    with Network("p") as net:
        x, r = Tensor("x", (Dim("n"), 64), torch.float32), Tensor("r", (Dim("n"), 64), torch.float32)
        s = x + r
        net.mark_output(F.rms_norm(s, Tensor("w", (64,), torch.float32), eps=1e-5), "h")
        net.mark_output(s, "s")
    work, rep = optimise(net)
    assert ops_of(work) == ["add_rms_norm"]
    assert work.nodes[0].attrs == {"eps": 1e-5}
    check_numbers(net, {"x": torch.randn(5, 64), "r": torch.randn(5, 64), "w": torch.randn(64)})


def test_add_rms_norm_near_misses_name_dtype_and_shape():
    with Network("p") as net:
        x, r16 = Tensor("x", (4, 32), torch.float32), Tensor("r16", (4, 32), torch.float16)
        w = Tensor("w", (32,), torch.float32)
        net.mark_output(F.rms_norm(x + F.cast(r16, torch.float16), w), "a")     # dtype differs
        net.mark_output(F.rms_norm(x + Tensor("row", (1, 32), torch.float32), w), "b")   # broadcast
    eng = net.build_engine(backend="torch", disable=["generic_fusion"])
    report = eng.fusion_report()
    assert "add_rms_norm: fused 0, near misses 2" in report
    assert "dtype: x is torch.float32 but the residual is torch.float16" in report
    assert "shape: the add broadcasts" in report


def test_swiglu_packed_and_extra_user_blocks():
    n = Dim("n")
    with Network("p") as net:
        gu = Tensor("gu", (n, 2 * 24), torch.float32)
        net.mark_output(F.activation(gu, F.ActType.SWIGLU), "y")
    work, _ = optimise(net)
    assert ops_of(work) == ["silu_mul"]
    check_numbers(net, {"gu": torch.randn(3, 48)})

    with Network("q") as net2:
        gu = Tensor("gu", (n, 48), torch.float32)
        g, u = F.split(gu, 2, -1)
        sg = F.silu(g)
        net2.mark_output(sg * u, "y")
        net2.mark_output(sg + 1.0, "also")       # silu(gate) is read outside the pattern
    eng = net2.build_engine(backend="torch", disable=["generic_fusion"])
    assert "silu_mul" not in ops_of(eng.net)
    assert "extra user: 'silu_" in eng.fusion_report()


def test_matmul_silu_mul_fuses_only_a_product_nothing_else_reads():
    n = Dim("n")
    with Network("p") as net:
        x = Tensor("x", (n, 16), torch.float32)
        w = Tensor("w", (48, 16), torch.float32)
        prod = F.linear(x, w, transpose_b=True)
        net.mark_output(F.activation(prod, F.ActType.SWIGLU), "y")
        net.mark_output(prod + 1.0, "also")          # the product is read outside the pattern
    eng = net.build_engine(backend="torch", disable=["generic_fusion"])
    assert "matmul_silu_mul" not in ops_of(eng.net) and "silu_mul" in ops_of(eng.net)
    assert "matmul_silu_mul: fused 0, near misses 1" in eng.fusion_report()
    with Network("q") as net2:
        x = Tensor("x", (n, 16), torch.float32)
        w = Tensor("w", (48, 16), torch.float32)
        net2.mark_output(F.activation(F.linear(x, w, transpose_b=True), F.ActType.SWIGLU), "y")
    work, _ = optimise(net2)
    assert ops_of(work) == ["matmul_silu_mul"] and work.nodes[0].attrs["transpose_b"] is True
    check_numbers(net2, {"x": torch.randn(3, 16), "w": torch.randn(48, 16)})


def test_gate_up_projections_become_one_gemm_with_folded_weights():
    n = Dim("n")
    with Network("p") as net:
        x = Tensor("x", (n, 16), torch.float32)
        wg, wu = Tensor("wg", (24, 16), torch.float32), Tensor("wu", (24, 16), torch.float32)
        net.mark_output(F.silu(F.linear(x, wg, transpose_b=True)) * F.linear(x, wu, transpose_b=True), "y")
    work, _ = optimise(net)
    assert ops_of(work) == ["cat", "matmul_silu_mul"]
    assert ops_of(optimise(net, disable=["matmul_silu_mul"])[0]) == ["cat", "matmul", "silu_mul"]
    w = {"wg": torch.randn(24, 16), "wu": torch.randn(24, 16)}
    ref, eng = check_numbers(net, {"x": torch.randn(5, 16), **w})
    before = eng.num_launches
    eng.set_weights(w)                      # the cat of the two weights is folded once
    assert eng.num_launches == before - 1
    assert "folded constants: 1" in eng.summary()
    x = torch.randn(5, 16)
    torch.testing.assert_close(eng.forward({"x": x})["y"], ref.forward({"x": x, **w})["y"], rtol=1e-5, atol=1e-5)
    # passing a bound weight explicitly bypasses the stale fold
    w2 = torch.randn(24, 16)
    torch.testing.assert_close(eng.forward({"x": x, "wg": w2})["y"], ref.forward({"x": x, "wg": w2, "wu": w["wu"]})["y"],
                               rtol=1e-5, atol=1e-5)


def test_rope_cache_fuses_and_writes_the_cache():
    feed = tiny_block.inputs(6, num_layers=1)
    net = tiny_block.build(1)
    work, _ = optimise(net)
    assert "rope_cache" in ops_of(work) and "rope" not in ops_of(work) and "reshape_and_cache" not in ops_of(work)
    w = tiny_block.weights(1)
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="torch")
    fa, fb = ({**w, **{k: v.clone() for k, v in feed.items()}} for _ in range(2))
    a, b = ref.forward(fa)["logits"], eng.forward(fb)["logits"]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb["k_cache0"], fa["k_cache0"])
    assert fb["k_cache0"].abs().sum() > 0


def _attention_net(prefill: bool, q_also_out: bool = False) -> Network:
    """rope -> cache write -> paged attention over one layer's caches (decode without query_start_loc)."""
    n, s = Dim("n"), Dim("s")
    with Network("attn") as net:
        q, k, v = (Tensor(x, (n, h, 8), torch.float32) for x, h in (("q", 4), ("k", 2), ("v", 2)))
        cos, sin = Tensor("cos", (n, 4), torch.float32), Tensor("sin", (n, 4), torch.float32)
        kc, vc = (Tensor(x, (6, 4, 2, 8), torch.float32) for x in ("kc", "vc"))
        q2, k2 = F.rope(q, k, cos, sin)
        kc, vc = F.reshape_and_cache(k2, v, kc, vc, Tensor("slots", (n,), torch.int64))
        qsl = Tensor("qsl", (Dim("s1"),), torch.int32) if prefill else None
        out = F.paged_attention(q2, kc, vc, Tensor("bt", (s, 3), torch.int32), Tensor("lens", (s,), torch.int32),
                                qsl, soft_cap=4.0)
        net.mark_output(out, "out")
        if q_also_out:
            net.mark_output(q2, "q_rotated")
    return net


def _decode_feed(lens=(5, 9, 1)):
    g = torch.Generator().manual_seed(3)
    n = len(lens)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [2, 0, 0]], dtype=torch.int32)
    pos = torch.tensor(lens) - 1
    freqs = pos[:, None].float() * torch.tensor([1.0, 0.1, 0.01, 0.001])[None, :]
    return {"q": torch.randn(n, 4, 8, generator=g), "k": torch.randn(n, 2, 8, generator=g),
            "v": torch.randn(n, 2, 8, generator=g), "cos": freqs.cos(), "sin": freqs.sin(),
            "kc": torch.randn(6, 4, 2, 8, generator=g), "vc": torch.randn(6, 4, 2, 8, generator=g),
            "slots": torch.tensor([int(tables[i, p // 4]) * 4 + int(p) % 4 for i, p in enumerate(pos)]),
            "bt": tables, "lens": torch.tensor(lens, dtype=torch.int32)}


def test_rope_cache_attention_fuses_decode_only():
    work, rep = optimise(_attention_net(prefill=False))
    assert ops_of(work) == ["rope_cache_attention"]
    assert any(r.name == "rope_cache_attention" and r.detail == "rope_cache_attention x1" for r in rep.records)
    feed = _decode_feed()
    ref, eng = check_numbers(_attention_net(prefill=False), feed)
    fa, fb = ({k: v.clone() for k, v in feed.items()} for _ in range(2))
    ref.forward(fa), eng.forward(fb)
    torch.testing.assert_close(fb["kc"], fa["kc"])                  # the cache is written in place
    assert not torch.equal(fb["kc"], feed["kc"])
    work, _ = optimise(_attention_net(prefill=True))
    assert ops_of(work) == ["rope_cache", "paged_attention"]


def test_rope_cache_attention_needs_the_rotated_q_unshared():
    net = _attention_net(prefill=False, q_also_out=True)
    work, _ = optimise(net)
    assert "rope_cache_attention" not in ops_of(work) and "paged_attention" in ops_of(work)
    eng = net.build_engine(backend="torch")
    assert "rope_cache_attention" in eng.fusion_report()


def test_matmul_epilogue_takes_bias_and_residual_not_followed_by_norm():
    n = Dim("n")
    with Network("p") as net:
        x, w, b = Tensor("x", (n, 16), torch.float32), Tensor("w", (32, 16), torch.float32), Tensor("b", (32,), torch.float32)
        h = F.linear(x, w, b, transpose_b=True)                    # bias epilogue
        res = Tensor("res", (n, 16), torch.float32)
        y = res + F.linear(h, Tensor("w2", (16, 32), torch.float32), transpose_b=True)   # residual epilogue
        net.mark_output(y, "y")
    work, rep = optimise(net, disable=["generic_fusion"])
    assert ops_of(work) == ["matmul_add", "matmul_add"]
    check_numbers(net, {"x": torch.randn(3, 16), "w": torch.randn(32, 16), "b": torch.randn(32),
                        "res": torch.randn(3, 16), "w2": torch.randn(16, 32)}, tol=1e-4)


# -- fusion report -------------------------------------------------------------------------------
class _Block(Module):
    def __init__(self):
        super().__init__()
        self.weight = Parameter((32,), torch.float32)

    def forward(self, x, r):
        s = x + r
        return F.rms_norm(s, self.weight), s


def test_fusion_report_names_disabled_pass_module_and_line():
    blk = _Block()
    with Network("p") as net:
        x, r = Tensor("x", (4, 32), torch.float32), Tensor("r", (4, 32), torch.float32)
        h, s = blk(x, r)
        net.mark_output(h, "h")
        net.mark_output(s, "s")
    eng = net.build_engine(backend="torch", disable=["add_rms_norm", "generic_fusion"])
    report = eng.fusion_report()
    line = next(i for i, l in enumerate(Path(__file__).read_text().splitlines(), 1) if "return F.rms_norm(s, self.weight), s" in l)
    assert "would fuse, but pass 'add_rms_norm' is disabled" in report
    assert f"test_passes_fusions.py:{line}" in report
    assert "disabled passes: add_rms_norm, generic_fusion" in report
    assert ops_of(eng.net) == ["add", "rms_norm"]


# -- generic fusion ------------------------------------------------------------------------------
def test_generic_fusion_groups_pointwise_chain_ending_in_reduction():
    n = Dim("n")
    with Network("p") as net:
        x, y = Tensor("x", (n, 32), torch.float32), Tensor("y", (32,), torch.float32)
        a = F.sigmoid(x) * y + 2.0
        net.mark_output(F.softmax(a * a, -1), "sm")
        net.mark_output(a, "a")
    work, rep = optimise(net)
    assert ops_of(work) == ["fused"]
    node = work.nodes[0]
    assert [p[0] for p in node.attrs["program"]] == ["sigmoid", "mul", "scalar", "add", "mul", "softmax"]
    assert len(node.outputs) == 2
    # the sub-program survives a JSON round trip
    again = Network.from_json(json.loads(json.dumps(work.to_json())))
    assert again == work
    check_numbers(net, {"x": torch.randn(4, 32), "y": torch.randn(32)})


def test_generic_fusion_does_not_create_cycles():
    n = Dim("n")
    with Network("p") as net:
        x, w = Tensor("x", (n, 8), torch.float32), Tensor("w", (8, 8), torch.float32)
        a = F.exp(x)
        m = F.matmul(a, w)              # a -> matmul -> c, and a -> c: fusing a with c needs the matmul inside
        net.mark_output(F.tanh(a) * m, "y")
    work, rep = optimise(net)
    work.lint()
    assert ops_of(work) == ["exp", "matmul", "fused"] or ops_of(work) == ["fused", "matmul", "mul"]
    check_numbers(net, {"x": torch.randn(3, 8), "w": torch.randn(8, 8)})


def test_cse_dce_and_canonicalize():
    n = Dim("n")
    with Network("p") as net:
        x, w = Tensor("x", (n, 8), torch.float32), Tensor("w", (8, 8), torch.float32)
        a, b = F.exp(x), F.exp(x)                                    # CSE
        F.sigmoid(x)                                                 # dead
        y = F.matmul(a + b, F.transpose(w, 0, 1))                    # transpose -> flag
        y = F.cast(F.cast(y, torch.float64), torch.float32)          # exact round trip
        net.mark_output(F.reshape(y, (-1, 8)), "y")                  # no-op reshape
    work, rep = optimise(net, disable=["generic_fusion"])
    assert ops_of(work) == ["exp", "add", "matmul"]
    assert work.nodes[2].attrs["transpose_b"] is True
    details = {r.name: r.detail for r in rep.records}
    assert details["dce"] == "removed 1 dead nodes" and details["cse"] == "merged 1 duplicate nodes"
    check_numbers(net, {"x": torch.randn(3, 8), "w": torch.randn(8, 8)})


def test_lossy_cast_round_trip_is_kept():
    with Network("p") as net:
        x = Tensor("x", (4,), torch.float32)
        net.mark_output(F.cast(F.cast(x, torch.bfloat16), torch.float32), "y")
    work, _ = optimise(net, passes=["canonicalize"])
    assert ops_of(work) == ["cast", "cast"]


# -- pass manager ---------------------------------------------------------------------------------
def test_unknown_pass_names_list_the_valid_ones(monkeypatch):
    with pytest.raises(Exception, match=r"unknown pass name\(s\) \['fuse_all'\]; valid passes, in order: \['dce'"):
        PassManager(disable=["fuse_all"])
    monkeypatch.setenv("GRAPHDSL_DISABLE_PASSES", "cse,nope")
    with pytest.raises(Exception, match="GRAPHDSL_DISABLE_PASSES: unknown pass name"):
        PassManager()


def test_env_disables_passes_and_order_is_declared(monkeypatch):
    monkeypatch.setenv("GRAPHDSL_DISABLE_PASSES", "swiglu, add_rms_norm")
    pm = PassManager(passes=["generic_fusion", "swiglu", "dce", "add_rms_norm"])
    assert pm.enabled == ["dce", "generic_fusion"]


def test_dump_dir_has_graph_after_every_pass_and_build_report(tmp_path):
    net = tiny_block.build(1)
    eng = net.build_engine(backend="torch", dump_dir=tmp_path, disable=["cse"])
    (d,) = list(tmp_path.iterdir())
    names = sorted(p.name for p in d.iterdir())
    expected = [f"{i:02d}-{p}{s}" for i, p in enumerate(pass_names(), 1) if p != "cse" for s in (".dot", ".txt")]
    assert set(expected) <= set(names)
    assert "02-cse.txt" not in names
    report = (d / "build_report.txt").read_text()
    assert "rope_cache x1" in report and "cse" in report and "disabled" in report
    idx = pass_names().index("add_rms_norm") + 1
    assert "add_rms_norm(" in (d / f"{idx:02d}-add_rms_norm.txt").read_text()
    assert "fusion_report.txt" in names
    assert eng.pass_report.seconds > 0


def test_lint_after_every_pass_names_the_pass(monkeypatch):
    from graphdsl.passes import manager

    def breaks_graph(ed, ctx):
        node = ed.nodes[0]
        node.outputs[0].dtype = torch.float16      # now disagrees with the shape rule
        return "broke it"

    monkeypatch.setattr(manager, "PIPELINE", manager.PIPELINE[:1] + [manager.PassSpec("broken", "", fn=breaks_graph)])
    with Network("p") as net:
        x = Tensor("x", (4,), torch.float32)
        net.mark_output(F.exp(x), "y")
    with pytest.raises(Exception, match="after pass 'broken'"):
        optimise(net)


# -- tiny transformer block -------------------------------------------------------------------------
def test_tiny_block_fused_engine_matches_reference_with_fewer_launches():
    w, feed = tiny_block.weights(2), tiny_block.inputs(9)
    net = tiny_block.build(2)
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="torch")
    eng.set_weights(w)
    got = eng.forward({k: v.clone() for k, v in feed.items()})["logits"]
    want = ref.forward({**w, **{k: v.clone() for k, v in feed.items()}})["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, tiny_block.torch_reference(w, feed), rtol=1e-4, atol=1e-4)
    assert eng.num_launches < ref.num_launches
    summary = eng.summary()
    assert f"kernel launches per forward: {eng.num_launches}" in summary
    assert "fused kernels: 8 (add_rms_norm x4, matmul_silu_mul x2, rope_cache x2" in summary


def test_build_time_of_32_layer_8b_graph():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import time

    from build_time import build_decoder
    net = build_decoder(32)
    t0 = time.perf_counter()
    eng = net.build_engine(backend="torch", lint=False)
    seconds = time.perf_counter() - t0
    assert eng.pass_report.records[-1].name == "generic_fusion"
    counts = {r.name: r.detail for r in eng.pass_report.records}
    assert counts["add_rms_norm"] == "add_rms_norm x64" and counts["rope_cache"] == "rope_cache x32"
    assert seconds < 10.0, f"build took {seconds:.2f} s"


def test_parameter_only_subgraph_is_left_unfused_and_folded_at_set_weights():
    n = Dim("n")
    with Network("p") as net:
        x = Tensor("x", (n, 16), torch.float32)
        g = Parameter((16,), torch.float32, name="gamma")
        w = Parameter((16, 16), torch.float32, name="w")
        scale = g * 0.5 + 1.0                                   # parameter-only pointwise chain
        h = F.rms_norm(x, scale)
        net.mark_output(F.matmul(h, F.transpose(w, 0, 1)), "y")   # transpose of a weight
    eng = net.build_engine(backend="torch")
    rec = {r.name: r.detail for r in eng.pass_report.records}
    # scalar 0.5, mul, scalar 1.0, add (the transpose became the matmul flag in canonicalize)
    assert rec["constant_fold"].startswith("4 parameter-only nodes")
    assert "rms_norm" in ops_of(eng.net)
    weights = {"gamma": torch.randn(16), "w": torch.randn(16, 16)}
    launches = eng.num_launches
    eng.set_weights(weights)
    assert eng.num_launches < launches
    x = torch.randn(3, 16)
    ref = net.build_engine(backend="torch", passes=[])
    torch.testing.assert_close(eng.forward({"x": x})["y"], ref.forward({"x": x, **weights})["y"], rtol=1e-5, atol=1e-5)


def test_qkv_projections_merge_into_one_gemm_with_folded_concat():
    n = Dim("n")
    with Network("p") as net:
        x = Tensor("x", (n, 16), torch.float32)
        ws = {k: Tensor(k, (rows, 16), torch.float32) for k, rows in (("wq", 16), ("wk", 8), ("wv", 8))}
        q, k, v = (F.linear(x, ws[name], transpose_b=True) for name in ("wq", "wk", "wv"))
        net.mark_output(q * 2.0, "q")
        net.mark_output(k + v, "kv")
    work, rep = optimise(net, disable=["generic_fusion"])
    assert ops_of(work)[:3] == ["cat", "matmul", "split"]
    assert work.nodes[2].attrs["sections"] == (16, 8, 8)
    assert {r.name: r.detail for r in rep.records}["merge_projections"].startswith("3 matmuls at")
    w = {"wq": torch.randn(16, 16), "wk": torch.randn(8, 16), "wv": torch.randn(8, 16)}
    ref, eng = check_numbers(net, {"x": torch.randn(5, 16), **w})
    before = eng.num_launches
    eng.set_weights(w)
    assert eng.num_launches == before - 1          # the weight concatenation is folded once
    x = torch.randn(4, 16)
    got, want = eng.forward({"x": x}), ref.forward({"x": x, **w})
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_projections_of_different_inputs_or_flags_stay_apart():
    with Network("p") as net:
        x, y = Tensor("x", (4, 16), torch.float32), Tensor("y", (4, 16), torch.float32)
        a = F.linear(x, Tensor("wa", (8, 16), torch.float32), transpose_b=True)
        b = F.linear(y, Tensor("wb", (8, 16), torch.float32), transpose_b=True)
        c = F.linear(x, Tensor("wc", (16, 8), torch.float32))                # other transpose flag
        net.mark_output(a + b, "ab")
        net.mark_output(c, "c")
    work, _ = optimise(net, passes=["merge_projections"])
    assert ops_of(work) == ["matmul", "matmul", "matmul", "add"]


def test_triton_backend_on_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with Network("p") as net:
        x = Tensor("x", (2, 4), torch.float32)
        net.mark_output(F.exp(x) + 1.0, "y")
    eng = net.build_engine(backend="triton")
    with pytest.raises(Exception, match=r"backend 'triton' runs on CUDA, or on CPU with TRITON_INTERPRET=1; "
                                         r"node 'fused_\d+' \(fused\) got CPU tensors"):
        eng.forward({"x": torch.randn(2, 4)})
