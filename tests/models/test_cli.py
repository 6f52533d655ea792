"""The graphdsl command line on a tiny GGUF model (the real-model demo is in test_smollm2.py)."""
import io

import pytest

from graphdsl.entrypoints.cli import build_parser, main
from graphdsl.errors import GraphDSLError
from tests.models.gguf_tiny import build_tiny_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path, _ = build_tiny_gguf(tmp_path_factory.mktemp("cli"))
    return str(path)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("demo", "generate", "chat", "dump"):
        assert cmd in out
    sub = build_parser()._subparsers._group_actions[0].choices
    assert "--chat" in sub["generate"].format_help() and "--out" in sub["dump"].format_help()


def test_generate_streams_text(gguf, capsys):
    assert main(["generate", gguf, "--prompt", "hello there", "--max-tokens", "6", "--device", "cpu",
                 "--temperature", "0"]) == 0       # greedy: an unseeded draw may end on EOS at once
    out = capsys.readouterr()
    assert out.out.strip() and "loading weights" in out.err
    assert main(["generate", gguf, "--prompt", "hi", "--chat", "--max-tokens", "4", "--temperature", "0.7",
                 "--seed", "3"]) == 0


def test_generate_reports_bad_input(gguf, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", gguf, "--prompt", "hi", "--temperature", "-1"])
    assert e.value.code == 2 and "argument --temperature: temperature must be a float >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "/no/such/model", "--prompt", "hi"])
    assert "argument model: model path '/no/such/model' not found" in capsys.readouterr().err


def test_chat_reads_turns_from_stdin(gguf, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nthe theme\n"))
    assert main(["chat", gguf, "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.count("\n") >= 2


def test_dump_writes_graphs_and_summaries(gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRAPHDSL_DUMP_DIR", raising=False)
    out = tmp_path / "dump"
    assert main(["dump", gguf, "--out", str(out)]) == 0
    for phase in ("prefill", "decode"):
        assert (out / phase / "summary.txt").read_text().startswith("Engine")
        assert (out / phase / "graph.txt").exists() and (out / phase / "00-recorded.txt").exists()
    assert "qkv_proj" in (out / "model.txt").read_text()
    assert (out / "config.json").exists() and any((out / "builds").iterdir())
    assert "Engine 'LlamaForCausalLM.decode'" in capsys.readouterr().out
    assert "GRAPHDSL_DUMP_DIR" not in __import__("os").environ


def test_check_command(gguf, tmp_path, capsys):
    assert main(["check", gguf]) == 0
    assert "supported" in capsys.readouterr().out
    (tmp_path / "config.json").write_text('{"model_type": "falcon", "architectures": ["FalconForCausalLM"]}')
    assert main(["check", str(tmp_path)]) == 1
    assert "unknown model_type 'falcon'" in capsys.readouterr().out


def test_check_quantization_names_what_llm_would_load(gguf, tmp_path, capsys):
    """``check --quantization`` notes the schemes ``LLM(quantization=)`` stores (the same words as
    ``llm.quantization``), and reports a scheme a weight cannot hold as ``LLM`` refuses it."""
    import graphdsl as gd
    assert main(["check", gguf, "--quantization", "int4"]) == 0
    loads = gd.LLM(gguf, device="cpu", max_model_len=32, max_num_seqs=1, quantization="int4").quantization
    assert f"note: quantization='int4': the linear weights load in {loads}" in capsys.readouterr().out
    assert main(["check", gguf, "--quantization", "int4-g128"]) == 1
    out = capsys.readouterr().out
    with pytest.raises(GraphDSLError) as refused:
        gd.LLM(gguf, device="cpu", max_model_len=32, max_num_seqs=1, quantization="int4-g128")
    assert f"unsupported: {refused.value}" in out and "not a multiple of the group size 128" in out
    assert main(["check", gguf, "--quantization", "gguf"]) == 0           # an F32 file: nothing to keep
    assert "note: quantization='gguf': no weight keeps the file's blocks" in capsys.readouterr().out
    from tests.models.hf_tiny import make_checkpoint
    make_checkpoint("llama", tmp_path)                   # full precision, not a .gguf file
    assert main(["check", str(tmp_path), "--quantization", "gguf"]) == 1
    assert "quantization='gguf' keeps the blocks of a GGUF file, but the model is" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        main(["check", gguf, "--quantization", "int3"])
    assert usage.value.code == 2 and "argument --quantization: quantization must be one of" in capsys.readouterr().err


def test_enforce_eager_turns_cuda_graphs_off(gguf, capsys, monkeypatch):
    """``--enforce-eager`` (vLLM's name) reaches ``LLM(cuda_graphs=False)``; without it graphs stay on."""
    import graphdsl as gd
    seen = []
    real = gd.LLM

    def spy(*args, **kw):
        seen.append(kw.get("cuda_graphs"))
        return real(*args, **kw)

    monkeypatch.setattr(gd, "LLM", spy)
    for extra in (["--enforce-eager"], []):
        assert main(["generate", gguf, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu",
                     "--temperature", "0", *extra]) == 0
    assert seen == [False, True]
    sub = build_parser()._subparsers._group_actions[0].choices
    assert "--enforce-eager" in sub["serve"].format_help()
