"""The row parts of a mixed-type GGUF weight side by side (``gguf_gemv(..., early_launch=,
beside=)``, the backend's ``_parts_beside``): the first part lets the next kernel in at its wait, the
CUDA-core part after it skips its own wait, reads its inputs from L2 and waits last. Under the CPU
interpreter (no PDL) the launches are the plain ones with those loads, so here they must give the
plain launches' bits; on a GPU the same is checked with PDL (tests/gpu/test_gguf_quant_gpu.py)."""
import pathlib
import sys

import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.kernels.gemv import GemvRmsIn, GemvWorkspace
from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
from graphdsl.runtime.gguf_blocks import to_stored
from tests.helpers.gguf_blocks import random_gguf_weight

pytest.importorskip("gguf")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(qtype, n, k, seed):
    data, _ = random_gguf_weight(qtype, n, k, seed=seed)
    return (to_stored(data, qtype) if qtype == "Q6_K" else data).to(DEV)


@pytest.mark.parametrize("rows", [1, 3])
def test_parts_beside_give_the_plain_launches_bits(rows):
    """A ``[Q4_K | Q6_K]`` product into column slices of one output, with a residual and a carried
    norm's factor, the Q6_K part split in three: ``early_launch`` / ``beside`` change no bit (one
    row: the Q4_K part on the tensor cores, the Q6_K part's one-row loop; three rows: both on the
    CUDA cores' dot path)."""
    k, n4, n6 = 512, 128, 64
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(DEV, torch.bfloat16)
    res = torch.randn(rows, n4 + n6, generator=g).to(DEV, torch.bfloat16)
    part = (x.float().reshape(rows, -1, 32).square().sum(-1) * 0.25).contiguous()
    q4, q6 = _weight("Q4_K", n4, k, 1), _weight("Q6_K", n6, k, 2)
    cfg4 = dict(MMA=True, BLOCK_N=64, SPLIT_K=2) if rows == 1 else None
    cfg6 = dict(SB=1, BLOCK_N=16, SPLIT_K=2)
    rms = GemvRmsIn(part, k, 1e-5)
    outs = []
    for side in (False, True):
        ws = GemvWorkspace()
        out = torch.full((rows, n4 + n6), float("nan"), dtype=torch.bfloat16, device=DEV)
        gguf_gemv(x, q4, "Q4_K", res[:, :n4], out=out[:, :n4], workspace=ws, config=cfg4, rms_in=rms,
                  early_launch=side)
        gguf_gemv(x, q6, "Q6_K", res[:, n4:], out=out[:, n4:], workspace=ws, config=cfg6, rms_in=rms, beside=side)
        outs.append(out)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[1], outs[0])


def test_a_part_beside_has_its_own_split_k_scratch():
    """Two GEMVs running at once must not share partials or arrival counters: a ``beside`` launch's
    buffers are not those of a sequential launch of the same grid."""
    ws, dev = GemvWorkspace(), torch.device(DEV)
    plain, side = ws.get(dev, 4, 3, 16), ws.get(dev, 4, 3, 16, beside=True)
    assert plain[0].data_ptr() != side[0].data_ptr() and plain[1].data_ptr() != side[1].data_ptr()
    assert ws.get(dev, 4, 3, 16, beside=True)[1].data_ptr() == side[1].data_ptr()     # kept for graphs


def test_beside_on_the_tensor_cores_is_refused():
    x = torch.randn(1, 256).to(DEV, torch.bfloat16)
    with pytest.raises(GraphDSLError, match=r"beside runs on the CUDA-core path only.*Q4_K \[64, 256\]"):
        gguf_gemv(x, _weight("Q4_K", 64, 256, 3), "Q4_K", config=dict(MMA=True, BLOCK_N=64, SPLIT_K=1), beside=True)


def test_which_parts_run_beside(monkeypatch):
    """Under PDL the parts after the first run beside it when all of them are on the CUDA cores;
    a second tensor-core part, one part, no PDL or the knob off: one after another."""
    from graphdsl.runtime.backends import triton_backend as tb
    from graphdsl.runtime.kernels import gguf_linear, pdl
    x = torch.randn(1, 256).to(DEV, torch.bfloat16)
    big, small = _weight("Q4_K", 256, 256, 4), _weight("Q6_K", 64, 256, 5)
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 128)       # the 256-row part on the tensor cores
    mix = [(big, ("Q4_K", 0, 256)), (small, ("Q6_K", 256, 320))]
    monkeypatch.setattr(pdl, "pdl_available", lambda device: False)
    assert not tb._parts_beside(x, mix)
    monkeypatch.setattr(pdl, "pdl_available", lambda device: True)
    assert tb._parts_beside(x, mix)
    assert not tb._parts_beside(x, mix[:1])
    assert not tb._parts_beside(x, [mix[1], mix[0]])             # a tensor-core part after the first
    monkeypatch.setattr(tb, "_PARTS_BESIDE", False)
    assert not tb._parts_beside(x, mix)


def test_a_q4_k_m_model_runs_its_v_rows_beside(monkeypatch):
    """A tiny model of the benchmark's Q4_K_M mix (``qkv_proj`` Q4_K rows then Q6_K ``v`` rows in
    some layers), steps eager on the Triton backend: with the parts beside, each mixed projection's
    Q6_K part is launched ``beside`` after an ``early_launch`` Q4_K part, and greedy tokens and
    their logprobs are bit for bit those of the parts one after another."""
    import graphdsl as gd
    from graphdsl.runtime.backends import triton_backend as tb
    from graphdsl.runtime.kernels import gguf_linear, pdl
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import quant
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128,
               max_position_embeddings=256, rms_norm_eps=1e-5)
    with quant._GGUFMix():
        llm = gd.LLM.from_config(cfg, device=DEV, dtype="bfloat16", seed=0, max_model_len=64, max_num_seqs=1,
                                 quantization="gguf-q4_k_m", init_std=0.1)
    llm.model.configure_runtime(backend="triton", cuda_graphs=False, max_blocks_per_seq=4)
    monkeypatch.setattr(gguf_linear, "MMA_MIN_ROWS", 256)      # q|k's 384 rows on the tensor cores, v's 128 not
    calls = []
    real = gguf_linear.gguf_gemv
    monkeypatch.setattr(gguf_linear, "gguf_gemv", lambda *a, **kw: calls.append(
        (a[2], kw.get("early_launch", False), kw.get("beside", False))) or real(*a, **kw))
    real_beside = tb._parts_beside

    def under_pdl(x, parts):            # the backend's own decision, as if PDL were there (no PDL on CPU)
        with monkeypatch.context() as m:
            m.setattr(pdl, "pdl_available", lambda device: True)
            return real_beside(x, parts)
    params = gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    got = {}
    for side in (False, True):
        monkeypatch.setattr(tb, "_parts_beside", under_pdl if side else real_beside)
        calls.clear()
        out = llm.generate([[5, 9, 2]], params)[0].outputs[0]
        got[side] = (out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
        flagged = [c for c in calls if c[1] or c[2]]
        if side:
            assert flagged and flagged == [("Q4_K", True, False), ("Q6_K", False, True)] * (len(flagged) // 2)
        else:
            assert not flagged
    assert got[True] == got[False]
