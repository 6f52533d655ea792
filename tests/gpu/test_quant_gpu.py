"""Quantized linears on the GPU: the Triton kernel at real projection shapes (decode and prefill rows)
and the fp8 ``torch._scaled_mm`` prefill path against the op's torch reference; a quantized tiny
model generates on CUDA like its CPU reference."""
import pytest
import torch

pytestmark = pytest.mark.gpu

SCHEMES = ["int8-channel", "int4-g128", "int4-g64-zp", "int4-g32", "int4-g128-kb", "int4-g64-zp-kb", "fp8-channel",
           "fp8-tensor", "fp8-channel-dyn"]


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("m", [1, 7, 16, 300])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_kernel_real_shapes(name, m, n, k):
    from graphdsl.functional.quant import quant_linear as op
    from graphdsl.quant import parse_scheme
    from graphdsl.runtime.kernels.quant_linear import quant_linear
    s = parse_scheme(name)
    g = torch.Generator(device="cuda").manual_seed(0)
    stored = s.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    want = op.opdef.reference(x, *stored, scheme=name, out_features=n, in_features=k).float()
    got = quant_linear(x, stored, s, n).float()
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("n,k,silu", [(6144, 4096, False), (4096, 14336, False), (28672, 4096, True)])
def test_w8a8_decode_gemv_real_shapes(m, n, k, silu):
    """fp8 with dynamic activation scales at decode sizes: the GEMV quantizes the rows itself and
    runs the e4m3 tensor cores, at the launch ``_pick_a8_config`` picks (K split, six stages) — the
    float64 product of the reference's quantized rows and codes, to the bf16 output's rounding."""
    from graphdsl.quant import parse_scheme, quantize_fp8_rows
    from graphdsl.runtime.kernels.gemv import gemv
    s = parse_scheme("fp8-channel-dyn")
    g = torch.Generator(device="cuda").manual_seed(m)
    q, sw = s.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    xq, sx = quantize_fp8_rows(x)
    prod = (xq.double() @ q.double().T) * sx.double() * sw.double().reshape(1, -1)
    if silu:
        gate, up = prod[:, : n // 2].bfloat16().double(), prod[:, n // 2:].bfloat16().double()
        prod = torch.nn.functional.silu(gate).bfloat16().double() * up
    got = gemv(x, q, silu_mul=silu, scheme=s, scales=sw).double()
    # half a bf16 ulp (SwiGLU: g, u and silu(g) each rounded); and on an H200 ~3% of the outputs land
    # one ulp off with the codes equal (also with the sums promoted after every instruction: the e4m3
    # tensor cores' own sum of an instruction's products): half an ulp of the largest (SwiGLU: one)
    torch.testing.assert_close(got, prod, rtol=2 ** -6 if silu else 2 ** -8,
                               atol=(2 ** -8 if silu else 2 ** -9) * prod.abs().max().item())


def test_fp8_dynamic_prefill_through_scaled_mm():
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    from graphdsl.quant import parse_scheme
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise torch._scaled_mm needs Hopper")
    s = parse_scheme("fp8-channel-dyn")
    with Network("q") as net:
        p = Parameter((512, 1024), torch.bfloat16, name="w").quantize(s)
        net.mark_output(F.linear(Tensor("x", (64, 1024), torch.bfloat16), p, None, transpose_b=True), "y")
    stored = s.quantize(torch.randn(512, 1024, device="cuda") * 0.05, torch.bfloat16)
    feed = {"x": torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16),
            **{c.name: t for c, t in zip(p.companions(), stored)}}
    got = net.build_engine(device="cuda:0", backend="triton").forward(feed)["y"].float()
    want = net.build_engine(device="cuda:0", backend="torch").forward(feed)["y"].float()
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8", "fp8-channel-dyn"])
def test_quantized_model_generates_like_torch_backend(quantization):
    import graphdsl as gd
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
              max_position_embeddings=256, rms_norm_eps=1e-5)
    llm = gd.LLM.from_config(hf, device="cuda", dtype="bfloat16", init_std=0.1, quantization=quantization,
                             max_model_len=128, max_num_seqs=2)
    if quantization == "int4":        # a CUDA bind stores the codes in blocks (layers.quantize.store_codes_in_blocks)
        assert {p.quant.name for _, p in llm.model.named_parameters() if p.quant is not None} == {"int4-g128-kb"}
    ids = list(range(5, 37))
    ours, short = llm.score(ids), llm.score(ids[:6])       # 6 rows: the decode GEMVs (W8A8 too)
    llm.model.configure_runtime(backend="torch", cuda_graphs=False)
    ref, ref_short = llm.score(ids), llm.score(ids[:6])
    torch.testing.assert_close(ours, ref, atol=0.1 * ref.abs().max().item(), rtol=0.05)
    if quantization.endswith("-dyn"):
        # W8A8: each backend quantizes its own bf16 activations, and a one-ulp difference upstream moves
        # an e4m3 code by a whole step (up to 1/8 of that input): on an H200 the logits of this random
        # model differ by 7.2% (norms carried) and 7.9% (launched) of their norm, one of 3072 by 0.547
        # against a 0.541 elementwise bound; a wrong row or scale moves them by far more than 10%
        assert (short - ref_short).norm() <= 0.1 * ref_short.norm(), (short - ref_short).norm() / ref_short.norm()
        torch.testing.assert_close(short, ref_short, atol=0.2 * ref_short.abs().max().item(), rtol=0.05)
    else:
        torch.testing.assert_close(short, ref_short, atol=0.1 * ref_short.abs().max().item(), rtol=0.05)


@pytest.mark.parametrize("writer", ["gptq", "ct"])
def test_act_order_checkpoint_on_cuda_scores_like_the_cpu(tmp_path, writer):
    """An act-order int4 checkpoint (GPTQ desc_act; compressed-tensors actorder group): the gather
    of x[..., perm] before the plain int4 kernels, in the decode graph and the prefill step, gives
    the CPU reference's logits; greedy tokens through CUDA graphs equal the eager torch backend's."""
    import graphdsl as gd
    from tests.models.quant_checkpoints import base_model, write_compressed_tensors, write_gptq
    base = base_model("llama", tmp_path / "base")
    if writer == "gptq":
        write_gptq(base, tmp_path / "q", group=32, sym=False, act_order=True)
    else:
        pytest.importorskip("compressed_tensors")
        write_compressed_tensors(base, tmp_path / "q", fmt="pack-quantized", act_order=True,
                                 weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    ids = [3, 17, 42, 99, 5, 120, 64, 7]
    cpu = gd.LLM(tmp_path / "q", device="cpu", max_model_len=64, max_num_seqs=2).score(ids)
    llm = gd.LLM(tmp_path / "q", device="cuda", dtype="float32", max_model_len=64, max_num_seqs=2)
    assert any(p.quant is not None and p.quant.name.endswith("-act-kb") for _, p in llm.model.named_parameters())
    torch.testing.assert_close(llm.score(ids).cpu(), cpu, atol=2e-3, rtol=2e-3)
    sp = gd.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    graphs = llm.generate([ids], sp)[0].outputs[0].token_ids
    llm.model.configure_runtime(backend="torch", cuda_graphs=False)
    assert llm.generate([ids], sp)[0].outputs[0].token_ids == graphs
