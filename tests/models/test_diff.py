"""``graphdsl diff``: graphdsl against HF transformers, module by module, on tiny random checkpoints.

A clean model diffs cleanly in every supported family; a deliberately broken op reference (the
test monkeypatches one) is named exactly, with its module, source line and fused kernel."""
import pytest
import torch

from graphdsl.entrypoints.cli import main
from graphdsl.entrypoints.diff import compare, diff_model
from graphdsl.opdef import get_op
from tests.models.hf_tiny import make_checkpoint

IDS = [3, 17, 42, 5, 99, 7]
FAMILIES = ["llama", "qwen2", "qwen3", "qwen2_moe", "gemma", "gemma2", "bloom", "mixtral", "deepseek_v2"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("diff-llama")
    return str(d), make_checkpoint("llama", d)


def _break(monkeypatch, op: str, factor: float = 1.01):
    opdef = get_op(op)
    good = opdef.reference
    monkeypatch.setattr(opdef, "reference", lambda *a, **k: good(*a, **k) * factor)


@pytest.mark.parametrize("family", FAMILIES)
def test_diff_is_clean_on_every_family(family, tmp_path):
    hf = make_checkpoint(family, tmp_path)
    report = diff_model(str(tmp_path), token_ids=IDS, hf_model=hf)
    assert report.ok, str(report)
    modules = {r.module for r in report.rows}
    assert len(report.rows) >= 8, str(report)
    assert any(m.endswith("lm_head") for m in modules) and report.logits.ok
    assert sum(1 for m in modules if ".mlp" in m or "mlp" in m.split(".")[-1]) >= 2, str(report)


def test_diff_names_the_broken_op(llama, monkeypatch):
    path, hf = llama
    _break(monkeypatch, "silu")
    report = diff_model(path, token_ids=IDS, hf_model=hf)
    first = report.first
    assert first is not None and not report.ok
    assert (first.op, first.module) == ("silu", "model.layers.0.mlp"), str(report)
    assert first.source.startswith("layers/mlp.py:") or "mlp.py:" in first.source
    assert first.kernel.startswith("'matmul_silu_mul_"), first.kernel
    assert first.row.module == "model.layers.0.mlp.down_proj"
    # every row before the divergence matched; the row itself is over tolerance
    before = [r for r in report.rows if r.order < first.row.order]
    assert before and all(r.ok for r in before) and not first.row.ok


def test_diff_names_a_broken_norm_in_attention_path(llama, monkeypatch):
    path, hf = llama
    _break(monkeypatch, "rms_norm", 1.02)
    first = diff_model(path, token_ids=IDS, hf_model=hf).first
    assert (first.op, first.module) == ("rms_norm", "model.layers.0.input_layernorm")
    assert first.row.module == "model.layers.0.input_layernorm"


def test_diff_cli(llama, capsys, monkeypatch):
    path, _ = llama
    assert main(["diff", path, "--token-ids", "3,17,42,5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj" in out and "no divergence" in out
    _break(monkeypatch, "embedding")
    assert main(["diff", path, "--token-ids", "3,17,42,5"]) == 1
    out = capsys.readouterr().out
    assert "first divergence: op 'embedding_0' (embedding)" in out and "module model.embed_tokens" in out
    assert "<-- over tolerance" in out


def test_diff_cli_quantization(llama, capsys):
    """``--quantization`` quantizes graphdsl's side online: against the full-precision reference the
    first divergence over a tight tolerance is the first quantized projection, and a loose tolerance
    passes (so the rows measure quantization, nothing else)."""
    path, _ = llama
    assert main(["diff", path, "--token-ids", "3,17,42,5", "--quantization", "int8", "--tolerance", "1e-6"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("graphdsl side quantized: int8-channel x")
    first = out[out.index("first divergence: "):]
    assert "(quant_linear)" in first and "module model.layers.0.self_attn.qkv_proj" in first, first
    assert main(["diff", path, "--token-ids", "3,17,42,5", "--quantization", "int8", "--tolerance", "0.2"]) == 0
    assert "no divergence" in capsys.readouterr().out


def test_diff_cli_rejects_bad_arguments(llama, capsys, tmp_path):
    path, _ = llama
    with pytest.raises(SystemExit):
        main(["diff", path, "--tolerance", "0"])
    assert "--tolerance" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["diff", path, "--token-ids", "a,b"])
    assert "expected integers" in capsys.readouterr().err


def test_compare_metrics():
    ref = torch.tensor([1.0, -2.0, 4.0])
    assert compare(ref, ref) == (0.0, 0.0, pytest.approx(1.0))
    max_rel, mean_rel, cos = compare(ref + torch.tensor([0.0, 0.0, 0.4]), ref)
    assert max_rel == pytest.approx(0.1) and mean_rel == pytest.approx(0.4 / 7) and cos < 1


def test_diff_kernel_check_names_a_wrong_fused_kernel(llama, monkeypatch):
    """The unfused graph still matches HF; the real engine's fused SwiGLU kernel does not."""
    path, hf = llama
    _break(monkeypatch, "matmul_silu_mul")
    report = diff_model(path, token_ids=IDS, hf_model=hf)
    assert report.first is None and all(r.ok for r in report.rows)
    assert not report.ok and not report.logits.ok
    k = report.kernel
    assert k is not None and k.kernels[0].startswith("'matmul_silu_mul_"), str(report)
    assert "(matmul_silu_mul) at layers/mlp.py:" in k.kernels[0]
    assert "kernel check:" in str(report)


def test_diff_of_quantized_gguf_against_its_hf_checkpoint(tmp_path, capsys):
    """Q8_0 q/k and Q4_0 MLP weights (a GGUF written the llama.cpp way, q/k rows permuted) against the
    float32 checkpoint they were quantized from: the first row over a tight tolerance is the first
    quantized projection, and each module's error shows what quantization costs it."""
    from gguf import GGMLQuantizationType as Q

    from tests.helpers.gguf_files import hf_model_to_gguf
    from tests.models.test_gguf import _tok_meta
    hf = make_checkpoint("llama", tmp_path / "hf", vocab_size=96)
    gguf = tmp_path / "q.gguf"
    hf_model_to_gguf(gguf, hf, "llama", tokenizer_meta=_tok_meta(96), quant={r"q_proj|k_proj": Q.Q8_0, r"mlp": Q.Q4_0})
    report = diff_model(str(gguf), token_ids=IDS[:4], tolerance=1e-3, hf_model=hf)
    rows = {r.module: r for r in report.rows}
    assert rows["model.embed_tokens"].ok and rows["model.layers.0.input_layernorm"].ok
    assert rows["model.layers.0.self_attn.v_proj"].max_rel < 1e-5          # F32: exact
    assert 1e-3 < rows["model.layers.0.self_attn.q_proj"].max_rel < 5e-2   # Q8_0
    assert rows["model.layers.0.mlp.gate_up_proj"].max_rel > rows["model.layers.0.self_attn.q_proj"].max_rel  # Q4_0
    first = report.first
    assert first.row.module == "model.layers.0.self_attn.q_proj" and first.op == "matmul", str(report)
    assert first.module == "model.layers.0.self_attn.qkv_proj"
    assert diff_model(str(gguf), token_ids=IDS[:4], tolerance=0.5, hf_model=hf).first is None
    with pytest.raises(SystemExit):
        main(["diff", str(gguf)])
    assert "a GGUF MODEL needs --reference" in capsys.readouterr().err
