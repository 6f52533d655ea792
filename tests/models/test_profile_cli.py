"""``graphdsl profile MODEL`` on CPU: both phase tables printed, one row per launch, files written."""
import json

import pytest

from graphdsl.entrypoints.cli import main
from graphdsl.layers import Phase
from graphdsl.runtime.profile import Ceilings
from tests.models.hf_tiny import make_checkpoint


def test_profile_cli_writes_tables_and_files(tmp_path, capsys):
    make_checkpoint("qwen2", tmp_path / "m")
    out = tmp_path / "prof"
    assert main(["profile", str(tmp_path / "m"), "--device", "cpu", "--prompt-tokens", "8", "--iters", "1",
                 "--top", "50", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prefill of 8 tokens on cpu" in text and "decode at 9 tokens of context, batch 1 on cpu" in text
    assert "add, rms_norm" in text                          # fused ops are listed
    for phase in ("prefill", "decode"):
        trace = json.loads((out / f"{phase}.trace.json").read_text())["traceEvents"]
        assert trace and all(e["ph"] == "X" and e["dur"] >= 0 for e in trace)
        assert (out / f"{phase}.svg").read_text().startswith("<svg")
    assert "<h2>prefill of 8 tokens</h2>" in (out / "profile.html").read_text()


def test_profile_cli_profiles_the_quantized_model(tmp_path, capsys):
    make_checkpoint("llama", tmp_path / "m")
    assert main(["profile", str(tmp_path / "m"), "--device", "cpu", "--prompt-tokens", "8", "--iters", "1",
                 "--top", "50", "--quantization", "int8"]) == 0
    assert "quant_linear" in capsys.readouterr().out


def test_profile_model_rows_equal_launches(tmp_path):
    import graphdsl as gd
    from graphdsl.entrypoints.profile import profile_model
    make_checkpoint("llama", tmp_path)
    llm = gd.LLM(str(tmp_path), device="cpu", max_model_len=32, max_num_seqs=1)
    reps = profile_model(llm, prompt_tokens=6, iters=1, warmup=0, ceilings=Ceilings(10.0, 0.1))
    for phase, rep in reps.items():
        assert len(rep.rows) == llm.model.engine(Phase(phase)).num_launches
    assert ("profile", 0) not in llm.blocks          # the step's blocks were given back


def test_profile_cli_needs_model_or_shape(capsys):
    with pytest.raises(SystemExit):
        main(["profile"])
    assert "give MODEL or --shape" in capsys.readouterr().err


def test_profile_shapes_are_the_benchmark_shapes():
    from graphdsl.entrypoints.cli import _bench_shapes, build_parser
    sub = build_parser()._subparsers._group_actions[0].choices["profile"]
    shape = next(a for a in sub._actions if a.dest == "shape")
    assert set(shape.choices) <= set(_bench_shapes())
