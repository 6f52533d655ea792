"""The RMSNorm between two decode GEMVs carried by their epilogues (``gemv(rms_out=)`` then
``gemv(rms_in=)``) against ``rms_norm`` between two plain products (CPU interpreter here, compiled
on a GPU)."""
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.opdef import get_op
from graphdsl.quant import parse_scheme
from graphdsl.runtime.kernels.gemv import RMS_CHUNK, GemvRmsIn, GemvRmsOut, gemv

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _t(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def _pair(m, n, k, n2, dtype, seed, silu=False):
    """x [m, k] -> y = x w1ᵀ + residual [m, n] -> rms_norm(y, g) -> · w2ᵀ ([n2, n]; with silu a packed
    [gate | up] of 2·n2 rows)."""
    g = torch.Generator().manual_seed(seed)
    return (_t(g, m, k, dtype=dtype), _t(g, n, k, dtype=dtype, scale=0.2), _t(g, m, n, dtype=dtype),
            (1 + _t(g, n, dtype=torch.float32, scale=0.2)).to(dtype),
            _t(g, (2 if silu else 1) * n2, n, dtype=dtype, scale=0.2))


def _carried(x, w1, res, gw, w2, *, silu=False, cfg1=None, cfg2=None, **quant2):
    m, n = res.shape
    y = torch.empty_like(res)
    scaled = torch.full_like(res, float("nan"))
    part = torch.full((m, -(-n // RMS_CHUNK)), float("nan"), device=DEV)
    gemv(x, w1, res, out=y, config=cfg1, rms_out=GemvRmsOut(gw, scaled, part))
    out = gemv(scaled, w2, silu_mul=silu, config=cfg2, rms_in=GemvRmsIn(part, n, EPS), **quant2)
    return y, scaled, part, out


def _normed(y, gw):
    return get_op("rms_norm").reference(y, gw, eps=EPS)


@pytest.mark.parametrize("m,split1,split2", [(1, 1, 1), (1, 3, 2), (3, 1, 4), (16, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_carried_by_the_epilogues_matches_rms_norm_between_products(m, split1, split2, dtype):
    n, k, n2 = 96, 64, 40
    x, w1, res, gw, w2 = _pair(m, n, k, n2, dtype, m * 10 + split1)
    cfg1 = dict(BLOCK_N=32, BLOCK_K=16, SPLIT_K=split1, num_warps=4, num_stages=2)
    cfg2 = dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=split2, num_warps=4, num_stages=2)
    y, scaled, part, out = _carried(x, w1, res, gw, w2, cfg1=cfg1, cfg2=cfg2)
    want_y = (x.float() @ w1.float().T + res.float()).to(dtype)
    torch.testing.assert_close(y.float(), want_y.float(), rtol=1e-2, atol=3e-2)
    # the epilogue's extra outputs: ŷ·w rounded (to the nearest on a GPU; the interpreter's bfloat16
    # cast may truncate: within one unit there), and Σŷ² per 32 columns
    tol = dict(rtol=0, atol=0) if DEV == "cuda" or dtype == torch.float16 else dict(rtol=2 ** -7, atol=0)
    torch.testing.assert_close(scaled, (y.float() * gw.float()).to(dtype), **tol)
    torch.testing.assert_close(part, y.float().pow(2).view(m, -1, RMS_CHUNK).sum(-1), rtol=1e-5, atol=1e-5)
    want = _normed(y, gw).float() @ w2.float().T
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=4e-2)


def test_carried_norm_into_a_swiglu_projection():
    dtype = torch.bfloat16
    x, w1, res, gw, w2 = _pair(2, 64, 64, 48, dtype, 5, silu=True)
    cfg2 = dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=2)
    y, _, _, out = _carried(x, w1, res, gw, w2, silu=True, cfg2=cfg2)
    prod = _normed(y, gw).float() @ w2.float().T
    gate, up = prod[:, :48].to(dtype).float(), prod[:, 48:].to(dtype).float()
    want = torch.nn.functional.silu(gate).to(dtype).float() * up
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=5e-2)


@pytest.mark.parametrize("scheme_name", ["int4-g128", "fp8-channel"])
def test_carried_norm_into_a_quantized_one_row_projection(scheme_name):
    """The one-row loops of the quantized GEMV (int4 integer dots, fp8 CUDA-core) take the row
    scale in the same epilogue."""
    dtype = torch.bfloat16
    n, n2 = 256, 64
    x, w1, res, gw, w2 = _pair(1, n, 128, n2, dtype, 9)
    scheme = parse_scheme(scheme_name)
    stored = [t.to(DEV) for t in scheme.quantize(w2.float().cpu(), dtype)]
    quant = dict(scheme=scheme, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
    y, scaled, part, out = _carried(x, w1, res, gw, stored[0], **quant)
    plain = gemv(_normed(y, gw), stored[0], **quant)
    torch.testing.assert_close(out.float(), plain.float(), rtol=3e-2, atol=6e-2)


@pytest.mark.parametrize("n,group,split", [(256, 64, 2), (192, 64, 1), (256, 128, 1)])
def test_a_one_row_producer_stores_its_int4_readers_packed_rows(n, group, split):
    """With ``packed`` the residual GEMV also stores ``ŷ·w`` as the int4 GEMV's packed activations:
    the bytes :func:`pack_int4_activations` makes of the stored rows (a last tile past ``N`` stores
    no word), read by the int4 GEMV as those are."""
    from graphdsl.runtime.kernels.int4_acts import pack_int4_activations
    dtype = torch.bfloat16
    x, w1, res, gw, w2 = _pair(1, n, 64, 64, dtype, n + group)
    scaled = torch.empty_like(res)
    part = torch.empty(1, n // RMS_CHUNK, device=DEV)
    packed = torch.full((6, n // 8), -7, dtype=torch.int32, device=DEV)
    cfg1 = dict(BLOCK_N=128, BLOCK_K=16, SPLIT_K=split, num_warps=4, num_stages=2)
    gemv(x, w1, res, config=cfg1, rms_out=GemvRmsOut(gw, scaled, part, packed, group))
    want = pack_int4_activations(scaled, group)
    assert torch.equal(packed[:5], want[:5])
    assert torch.equal(packed[5, :n // group], want[5, :n // group])
    assert (packed[5, n // group:] == -7).all()              # past the groups: untouched
    scheme = parse_scheme(f"int4-g{group}")
    codes, scales = [t.to(DEV) for t in scheme.quantize(w2.float().cpu(), dtype)]
    quant = dict(scheme=scheme, scales=scales, rms_in=GemvRmsIn(part, n, EPS))
    assert torch.equal(gemv(scaled, codes, xpack=packed, **quant), gemv(scaled, codes, xpack=want, **quant))


def test_packed_rows_need_one_row_and_whole_groups_a_tile():
    x, w1, res, gw, _ = _pair(2, 128, 32, 16, torch.bfloat16, 3)
    scaled, part = torch.empty_like(res), torch.empty(2, 4, device=DEV)
    packed = torch.empty(6, 16, dtype=torch.int32, device=DEV)
    cfg = dict(BLOCK_N=64, BLOCK_K=16, SPLIT_K=1)
    with pytest.raises(GraphDSLError, match="rms_out.packed needs one row and tiles of whole groups, got 2 rows"):
        gemv(x, w1, res, config=cfg, rms_out=GemvRmsOut(gw, scaled, part, packed, 64))
    with pytest.raises(GraphDSLError, match="pack_group 128, BLOCK_N 64"):
        gemv(x[:1], w1, res[:1], config=cfg, rms_out=GemvRmsOut(gw, scaled[:1], part[:1], packed, 128))
    with pytest.raises(GraphDSLError, match=r"rms_out.packed must be a contiguous int32 \[6, 16\]"):
        gemv(x[:1], w1, res[:1], config=cfg, rms_out=GemvRmsOut(gw, scaled[:1], part[:1], packed[:, :8], 64))


def test_rms_arguments_are_checked():
    x, w1, res, gw, w2 = _pair(2, 64, 32, 16, torch.float16, 1)
    scaled, part = torch.empty_like(res), torch.empty(2, 2, device=DEV)
    with pytest.raises(GraphDSLError, match="rms_out.partials must be a contiguous \\[2, 2\\]"):
        gemv(x, w1, res, rms_out=GemvRmsOut(gw, scaled, torch.empty(2, 3, device=DEV)))
    with pytest.raises(GraphDSLError, match="rms_out needs a plain product in tiles of a multiple of 32"):
        gemv(x, w1, res, rms_out=GemvRmsOut(gw, scaled, part),
             config=dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=1))
    with pytest.raises(GraphDSLError, match="rms_in needs n = K = 64"):
        gemv(res, w2, rms_in=GemvRmsIn(part, 32, EPS))


# -- the backend's schedule: the tiny transformer block ---------------------------------------------
def _norm_launches(monkeypatch) -> list:
    """The names of the ``add_rms_norm`` nodes the Triton backend launches a kernel for, as they run."""
    from graphdsl.runtime.backends import triton_backend
    launched = []
    real = triton_backend._LOWERINGS["add_rms_norm"]
    monkeypatch.setitem(triton_backend._LOWERINGS, "add_rms_norm",
                        lambda be, node, *a: launched.append(node.name) or real(be, node, *a))
    return launched


@pytest.mark.parametrize("num_tokens", [3, 20])
def test_tiny_block_norms_ride_on_the_gemvs_up_to_16_rows(num_tokens, monkeypatch):
    """In fp16 with <= 16 rows each ``add_rms_norm`` after a projection (o, down: 2 a layer, the last
    one before the lm_head) launches nothing: its producer GEMV and its readers carry it; with more
    rows each launches its kernel. Both match the unfused torch reference. (fp16 weights are carried
    when ``KINDS`` names them, as by default; int4 producers too, below.)"""
    from graphdsl.runtime.backends import norm_carry
    from tests.helpers import tiny_block
    monkeypatch.setattr(norm_carry, "KINDS", ("float",))
    launched = _norm_launches(monkeypatch)
    dt = torch.float16
    w, feed = tiny_block.weights(2, dtype=dt), tiny_block.inputs(num_tokens, dtype=dt)
    net = tiny_block.build(2, dtype=dt)
    ref = net.build_engine(backend="torch", passes=[])
    eng = net.build_engine(backend="triton", cache=False)
    eng.set_weights({k: v.to(DEV) for k, v in w.items()})
    got = eng.forward({k: v.clone().to(DEV) for k, v in feed.items()})["logits"].cpu().float()
    want = ref.forward({**w, **{k: v.clone() for k, v in feed.items()}})["logits"].float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    norms = [n.name for n in eng.net.nodes if n.op == "add_rms_norm"]
    assert len(norms) == 4
    assert launched == ([] if num_tokens <= 16 else norms)


def test_a_consumer_leaving_the_gemv_after_its_norm_was_carried_is_an_error(monkeypatch):
    """Should a reader of a carried norm not run as a GEMV after all, the run stops with an error
    naming the node; it never multiplies the unscaled rows."""
    from graphdsl.runtime.backends import norm_carry, triton_backend
    from tests.helpers import tiny_block
    monkeypatch.setattr(norm_carry, "KINDS", ("float",))
    monkeypatch.setattr(triton_backend, "_gemv_rows", lambda *a: False)   # the producer still runs the GEMV
    dt = torch.float16
    eng = tiny_block.build(1, dtype=dt).build_engine(backend="triton", cache=False)
    eng.set_weights({k: v.to(DEV) for k, v in tiny_block.weights(1, dtype=dt).items()})
    feed = {k: v.to(DEV) for k, v in tiny_block.inputs(2, num_layers=1, dtype=dt).items()}
    with pytest.raises(GraphDSLError, match=r"node 'matmul_silu_mul_\d+' \(matmul_silu_mul\): its input's RMSNorm "
                                            r"was left to its GEMV .* but it does not run as one"):
        eng.forward(dict(feed))


def test_a_per_node_hook_sees_every_norm_launch(monkeypatch):
    """Taps read every node's output, so a tapped run carries no norm (and the tapped normed value is
    the norm's own)."""
    from graphdsl.runtime.backends import norm_carry
    from tests.helpers import tiny_block
    monkeypatch.setattr(norm_carry, "KINDS", ("float",))
    launched = _norm_launches(monkeypatch)
    dt = torch.float16
    eng = tiny_block.build(1, dtype=dt).build_engine(backend="triton", cache=False)
    eng.set_weights({k: v.to(DEV) for k, v in tiny_block.weights(1, dtype=dt).items()})
    feed = {k: v.to(DEV) for k, v in tiny_block.inputs(2, num_layers=1, dtype=dt).items()}
    eng.forward(dict(feed), taps=["op:*"])
    assert len(launched) == 2
    # an empty selection (what a CUDA-graph capture passes when nothing is tapped) installs no hook
    feed = {k: v.to(DEV) for k, v in tiny_block.inputs(2, num_layers=1, dtype=dt).items()}
    eng.forward(dict(feed), taps={})
    assert len(launched) == 2


def test_tiny_llama_in_bfloat16_scores_alike_with_and_without_carried_norms(tmp_path, monkeypatch):
    """A Llama checkpoint in bfloat16 on the Triton backend: 11 prompt rows carry every norm after a
    projection; the logits stay as close to transformers' as with each norm launched."""
    import graphdsl as gd
    from graphdsl.runtime.backends import norm_carry
    from tests.models.hf_tiny import hf_logits, make_checkpoint
    launched = _norm_launches(monkeypatch)
    hf_model = make_checkpoint("llama", tmp_path)
    prompt = [1, 5, 9, 33, 2, 77, 100, 3, 8, 9, 10]
    ref = hf_logits(hf_model, prompt)
    monkeypatch.setattr(norm_carry, "KINDS", ("float",))
    got, launches = {}, {}
    for carried in (True, False):
        monkeypatch.setattr(norm_carry, "ENABLED", carried)
        llm = gd.LLM(tmp_path, device=DEV, dtype="bfloat16", max_model_len=64)
        llm.model.configure_runtime(backend="triton", max_blocks_per_seq=4)
        launched.clear()
        got[carried] = llm.score(prompt).float().cpu()
        launches[carried] = len(launched)
    # 2 layers: every add_rms_norm launched, or only the last (its rows are gathered before the lm_head)
    assert launches == {True: 1, False: 4}
    scale = ref.abs().max()
    err = {c: ((got[c] - ref).abs().max() / scale).item() for c in got}
    assert err[True] <= max(2 * err[False], 1e-2), err


def _buffers_stay_unshared(nodes, sites):
    """No site's buffer is taken by another producer between its producer and its last reader."""
    at = {n: i for i, n in enumerate(nodes)}
    for a in sites:
        end = max(at[c] for c in a.consumers)
        for b in sites:
            assert b is a or b.slot != a.slot or not at[a.producer] < at[b.producer] <= end


def test_plan_keeps_a_site_only_when_a_buffer_is_free():
    """Sites take the two scratch buffers in turn; a site whose producer comes while both buffers
    still have readers to come is left out."""
    from graphdsl.runtime.backends.norm_carry import plan
    from tests.helpers import tiny_block
    eng = tiny_block.build(2, dtype=torch.float16).build_engine(backend="triton", cache=False)
    nodes = list(eng.net.nodes)
    sites = sorted(set(plan(nodes).values()), key=lambda s: nodes.index(s.producer))
    assert [s.slot for s in sites] == [0, 1, 0, 1]
    _buffers_stay_unshared(nodes, sites)
    # the first two sites' readers moved after the third site's producer: no buffer is free for it
    (r0,), (r1,) = sites[0].consumers, sites[1].consumers
    moved = [n for n in nodes if n not in (r0, r1)]
    at = moved.index(sites[2].producer) + 2           # after the third site's norm
    moved[at:at] = [r0, r1]
    kept = set(plan(moved).values())
    assert sites[2].norm not in {s.norm for s in kept} and len(kept) == 3
    _buffers_stay_unshared(moved, kept)


def test_partials_and_residual_read_after_the_loop_give_the_same_bits(monkeypatch):
    """``_RMS_EARLY`` only moves the reads of the partials and the residual before the K loop."""
    import graphdsl.runtime.kernels.gemv as gemv_module
    x, w1, res, gw, w2 = _pair(3, 64, 64, 32, torch.float16, 11)
    cfg1 = dict(BLOCK_N=32, BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=2)
    early = _carried(x, w1, res, gw, w2, cfg1=cfg1)
    monkeypatch.setattr(gemv_module, "_RMS_EARLY", False)
    late = _carried(x, w1, res, gw, w2, cfg1=cfg1)
    for a, b in zip(early, late):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)   # (ptxas may contract the sums otherwise)


@pytest.mark.parametrize("quantization,carried", [("int4-g64", 3), ("fp8", 0), (None, 3)])
def test_by_default_int4_and_float_producers_carry_their_norm(quantization, carried, tmp_path, monkeypatch):
    """The default ``KINDS``: the sites whose producer holds int4 codes or bf16 weights carry their
    norm (measured faster); fp8 ones launch it (measured slower). A 2-layer Llama scoring 5 tokens: 4
    ``add_rms_norm``, the last one's rows gathered before the lm_head."""
    import graphdsl as gd
    from tests.models.hf_tiny import make_checkpoint
    launched = _norm_launches(monkeypatch)
    make_checkpoint("llama", tmp_path, intermediate_size=128)       # int4-g64 groups divide every K
    llm = gd.LLM(tmp_path, device=DEV, dtype="bfloat16", max_model_len=64, quantization=quantization)
    llm.model.configure_runtime(backend="triton", max_blocks_per_seq=4)
    llm.score([1, 5, 9, 33, 2])
    assert len(launched) == 4 - carried


def test_int4_gate_up_of_a_carried_norm_takes_the_rows_its_producer_packed(tmp_path, monkeypatch):
    """A 2-layer int4 Llama decoding one row, gate/up reading packed rows (``_XPACK_MIN_WEIGHTS``
    lowered to this model's size): each layer's o GEMV stores them with the carried norm and the
    gate/up reads them, where without ``PACK`` a launch makes them — the logits of the two agree up
    to rounding (the launches differ, so float32 sums may round differently; int4's own error is far
    larger). The qkv GEMVs make their bytes in their loop either way."""
    import graphdsl as gd
    from graphdsl.runtime.backends import norm_carry, triton_backend
    from tests.models.hf_tiny import make_checkpoint
    make_checkpoint("llama", tmp_path, intermediate_size=128)
    monkeypatch.setattr(triton_backend, "_XPACK_MIN_WEIGHTS", 1)
    taken, launched = [], []
    real, real_launch = norm_carry.NormCarry.xpack, triton_backend._int4_xpack
    monkeypatch.setattr(norm_carry.NormCarry, "xpack",
                        lambda self, node, scheme: (lambda p: taken.append(node.op) or p if p is not None else p)(
                            real(self, node, scheme)))
    monkeypatch.setattr(triton_backend, "_int4_xpack", lambda be, x, *a: launched.append(x.shape) or real_launch(be, x, *a))
    got = {}
    for pack in (True, False):
        monkeypatch.setattr(norm_carry, "PACK", pack)
        llm = gd.LLM(tmp_path, device=DEV, dtype="bfloat16", max_model_len=64, quantization="int4-g64")
        llm.model.configure_runtime(backend="triton", max_blocks_per_seq=4)
        taken.clear(), launched.clear()
        got[pack] = llm.score([7]).float().cpu()
        assert (taken, len(launched)) == ((["quant_linear_silu_mul"] * 2, 0) if pack else ([], 2))
    err = ((got[True] - got[False]).abs().max() / got[False].abs().max()).item()
    assert err < 2e-2, err
