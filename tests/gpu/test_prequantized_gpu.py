"""Pre-quantized checkpoints on the GPU: tiny compressed-tensors / AWQ / GPTQ checkpoints (the CPU
tests' writers) load on CUDA in bfloat16 and score like the same checkpoint on the CPU in float32
(whose match with transformers tests/models/test_prequantized.py checks)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

IDS = list(range(5, 37))


def _int(bits, sym=True, group=None):
    return dict(num_bits=bits, type="int", symmetric=sym, strategy="group" if group else "channel", group_size=group)


CASES = {
    "ct-int4-g128-zp": ("ct", dict(fmt="pack-quantized", weights=_int(4, sym=False, group=128))),
    "ct-int4-g32": ("ct", dict(fmt="pack-quantized", weights=_int(4, group=32))),
    "ct-int8": ("ct", dict(fmt="pack-quantized", weights=_int(8))),
    "ct-fp8-tensor": ("ct", dict(fmt="float-quantized", weights=dict(num_bits=8, type="float", strategy="tensor"))),
    "awq-g64": ("awq", dict(group=64)),
    "gptq-sym-g128": ("gptq", dict(group=128, sym=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prequantized_checkpoint_on_cuda_scores_like_cpu(case, tmp_path):
    import graphdsl as gd
    from tests.models.quant_checkpoints import base_model, write_awq, write_compressed_tensors, write_gptq
    writer, kw = CASES[case]
    if writer == "ct":
        pytest.importorskip("compressed_tensors")
    hf = base_model("llama", tmp_path / "base")
    {"ct": write_compressed_tensors, "awq": write_awq, "gptq": write_gptq}[writer](hf, tmp_path / "q", **kw)
    ref = gd.LLM(tmp_path / "q", device="cpu", max_model_len=64, max_num_seqs=1).score(IDS)
    llm = gd.LLM(tmp_path / "q", device="cuda", dtype="bfloat16", max_model_len=64, max_num_seqs=1)
    assert any(p.quant is not None for _, p in llm.model.named_parameters())
    ours = llm.score(IDS).float().cpu()
    torch.testing.assert_close(ours, ref, atol=0.1 * ref.abs().max().item(), rtol=0.05)
    # and greedy decode steps (the quantized GEMV, CUDA graphs) run on it
    out = llm.generate([IDS], gd.SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
