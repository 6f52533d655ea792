"""Every CLI subcommand with bad values: an error naming the argument, no Python traceback, and
nothing loaded first (weights loading is made to fail the test). Plus the CLI's smaller contracts:
--version, help text, dump's short stdout, --custom-module-map on every model command, tokenizer-less
models refused up front, sampling defaults from the checkpoint, chat history that outgrows the model."""
import io
import os
import subprocess
import sys

import pytest
import torch

from graphdsl.entrypoints import cli
from graphdsl.entrypoints.cli import build_parser, main
from tests.models.gguf_tiny import build_tiny_gguf
from tests.models.hf_tiny import make_checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_args")
    gguf, _ = build_tiny_gguf(d)
    make_checkpoint("llama", d / "hf")                 # a HF directory without tokenizer.json
    (d / "a_file.txt").write_text("x")
    (d / "empty_dir").mkdir()
    (d / "map.txt").write_text("")
    return {"gguf": str(gguf), "hf": str(d / "hf"), "file": str(d / "a_file.txt"), "dir": str(d / "empty_dir"),
            "safetensors": str(d / "hf" / "model.safetensors"), "not_py": str(d / "map.txt"),
            "missing": str(d / "missing")}


_DEVICES = [("--device", "tpu"), ("--device", "gpu"), ("--device", "cuda:abc"), ("--device", ""),
            ("--device", "cuda:99" if torch.cuda.is_available() else "cuda")]
_SAMPLING = [("--top-p", "2"), ("--top-p", "0"), ("--temperature", "-1"), ("--top-k", "-2"),
             ("--repetition-penalty", "0"), ("--max-tokens", "0"), ("--max-tokens", "many"), ("--seed", "x"),
             ("--stop", ""), ("--temperature", "hot")]
_RUNTIME = _DEVICES + [("--dtype", "int8"), ("--max-model-len", "0"), ("--max-model-len", "-3"),
                       ("--threads", "0"), ("--custom-module-map", "{missing}.py"),
                       ("--custom-module-map", "{not_py}"), ("--optimize-rules", "{missing}.yaml"),
                       ("--optimize-rules", "{file}")]
_MODELS = ["{missing}", "{file}", "{dir}", "{safetensors}", ""]


def _cases():
    base = {"generate": ["generate", "{gguf}", "--prompt", "hi"], "chat": ["chat", "{gguf}"],
            "dump": ["dump", "{gguf}", "--out", "{dir}/out"], "demo": ["demo"]}
    for cmd, argv in base.items():
        for flag, value in _RUNTIME:
            if cmd == "demo" and flag in ("--dtype", "--max-model-len"):
                continue
            yield argv + [flag, value], flag
        if cmd != "dump":
            for flag, value in _SAMPLING:
                yield argv + [flag, value], flag
    for cmd, argv in (("generate", ["generate", "{m}", "--prompt", "hi"]), ("chat", ["chat", "{m}"]),
                      ("dump", ["dump", "{m}", "--out", "{dir}/o"]), ("check", ["check", "{m}"])):
        for model in _MODELS:
            yield [a.replace("{m}", model) for a in argv], "argument model"
    yield ["generate", "{gguf}", "--prompt", ""], "--prompt"
    yield ["generate", "{gguf}"], "--prompt"
    yield ["chat", "{gguf}", "--system", ""], "--system"
    yield ["demo", "--prompt", ""], "--prompt"
    yield ["dump", "{gguf}", "--out", "{file}"], "--out"
    yield ["dump", "{gguf}"], "--out"
    yield ["dump", "{gguf}", "--out", "{dir}/o", "--prompt", ""], "--prompt"
    yield ["check", "{gguf}", "--custom-module-map", "{missing}.py"], "--custom-module-map"
    yield ["check", "{gguf}", "--optimize-rules", "{file}"], "--optimize-rules"
    yield ["cache", "list", "--dir", "{file}"], "--dir"
    yield ["cache", "purge"], "action"
    yield ["bench", "--shape", "gpt-9"], "--shape"
    yield ["bench", "--shape", "llama-3-8b", "--batches", "0"], "--batches"
    yield ["bench", "--shape", "llama-3-8b", "--out", "{dir}"], "--out"
    yield ["bench", "--shape", "llama-3-8b", "--out", "{missing}/t.md"], "--out"
    if not torch.cuda.is_available():
        yield ["bench", "--shape", "llama-3-8b"], "needs a CUDA GPU"
    yield ["generate", "{gguf}", "--prompt", "hi", "--max-model-len", "100000"], "max_model_len=100000"
    yield ["generate", "{hf}", "--prompt", "hi"], "has no tokenizer.json"
    yield ["chat", "{hf}"], "has no tokenizer.json"
    for flag, value in _RUNTIME + [("--port", "0"), ("--port", "http"), ("--max-num-seqs", "0"),
                                   ("--served-model-name", ""), ("--api-key", ""),
                                   ("--chat-template", "{missing}.jinja"), ("--chat-template", "{dir}")]:
        yield ["serve", "{gguf}", flag, value], flag
    for model in _MODELS:
        yield ["serve", model], "argument model"
    yield ["diff", "{gguf}"], "argument model: diff compares with HF transformers"      # not --reference: not given
    yield ["diff", "{gguf}", "--reference", "{gguf}"], "argument --reference: diff compares"
    yield ["frobnicate"], "invalid choice: 'frobnicate'"
    yield ["--bogus"], "--bogus"


CASES = list(_cases())


@pytest.mark.parametrize("argv, names", CASES, ids=[" ".join(a) or "''" for a, _ in CASES])
def test_bad_argument_is_named_before_anything_loads(files, argv, names, capsys, monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the arguments were checked")
    monkeypatch.setattr("graphdsl.entrypoints.llm.load_weights", no_weights)
    if argv == ["demo"] or argv[:1] == ["demo"]:
        monkeypatch.setattr(cli, "smollm2_path", lambda: files["gguf"])
    argv = [a.format(**files) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert "Traceback" not in err and names.format(**files) in err, err
    assert err.rstrip().splitlines()[-1].startswith(("graphdsl", "usage")), err


@pytest.mark.parametrize("flag,value,expected", [("--temperature", "hot", "expected a number, got 'hot'"),
                                                 ("--top-p", "most", "expected a number, got 'most'"),
                                                 ("--top-k", "1.5", "expected an integer, got '1.5'"),
                                                 ("--seed", "x", "expected an integer, got 'x'")])
def test_sampling_flags_that_are_no_number_say_what_they_expect(files, flag, value, expected, capsys):
    """Not argparse's "invalid float value": the words of the other number flags."""
    with pytest.raises(SystemExit):
        main(["generate", files["gguf"], "--prompt", "hi", flag, value])
    assert f"argument {flag}: {expected}" in capsys.readouterr().err


def test_no_traceback_from_a_real_process(files):
    """The in-process cases above, checked once for real: exit status 2, the message, no traceback."""
    r = subprocess.run([sys.executable, "-m", "graphdsl.entrypoints.cli", "generate", files["gguf"], "--prompt", "hi",
                        "--device", "tpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "argument --device: 'tpu' is not a device graphdsl runs on" in r.stderr


def test_piped_stderr_has_no_carriage_returns(files, tmp_path):
    with open(tmp_path / "err.log", "w") as err:
        r = subprocess.run([sys.executable, "-m", "graphdsl.entrypoints.cli", "generate", files["gguf"], "--prompt",
                            "hello", "--max-tokens", "3", "--device", "cpu"], stdout=subprocess.PIPE, stderr=err,
                           timeout=300)
    log = (tmp_path / "err.log").read_bytes()
    assert r.returncode == 0 and b"loading weights:" in log and b"\r" not in log


def test_chat_with_piped_input_writes_only_the_answers(files):
    """No "> " prompts in a piped transcript: stdout is the answers, one a line."""
    r = subprocess.run([sys.executable, "-m", "graphdsl.entrypoints.cli", "chat", files["gguf"], "--max-tokens", "2",
                        "--device", "cpu", "--temperature", "0"], input="hi\nhow are you\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "> " not in r.stdout and len(r.stdout.splitlines()) == 2, repr(r.stdout)


def test_version(capsys):
    import graphdsl
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"graphdsl {graphdsl.__version__}"


def test_help_texts_render_cleanly():
    sub = build_parser()._subparsers._group_actions[0].choices
    for name, p in sub.items():
        text = p.format_help()
        assert "%%" not in text, name
    assert "% of roofline" in sub["bench"].format_help()
    assert "graphdsl demo" in build_parser().format_help()                  # where a newcomer starts
    assert "default: the model's max_position_embeddings, at most 2048" in " ".join(sub["serve"].format_help().split())
    for name in ("generate", "chat", "dump", "check", "demo"):
        assert "--custom-module-map" in sub[name].format_help(), name


def test_dump_prints_a_short_summary(files, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRAPHDSL_DUMP_DIR", raising=False)
    assert main(["dump", files["gguf"], "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert len(out) < 1500 and "model.layers.0" not in out, out
    assert os.path.join(str(tmp_path / "d"), "decode", "summary.txt") in out
    assert "model.layers.0" in (tmp_path / "d" / "decode" / "summary.txt").read_text()


_MAP = '''
from graphdsl.models.llama import LlamaForCausalLM


class MarkedLlama(LlamaForCausalLM):
    model_types = ("llama",)


MODULE_MAP = {"LlamaForCausalLM": MarkedLlama}
'''


@pytest.mark.parametrize("argv", [["generate", "{gguf}", "--prompt", "hi", "--max-tokens", "1"],
                                  ["dump", "{gguf}", "--out", "{out}"], ["check", "{gguf}"]])
def test_custom_module_map_on_every_model_command(files, tmp_path, argv, capsys, monkeypatch):
    from graphdsl.models import registry
    monkeypatch.setattr(registry, "_BY_ARCH", dict(registry._BY_ARCH))    # the map's override ends with the test
    monkeypatch.setattr(registry, "_BY_TYPE", dict(registry._BY_TYPE))
    monkeypatch.delenv("GRAPHDSL_DUMP_DIR", raising=False)
    (tmp_path / "map.py").write_text(_MAP)
    argv = [a.format(out=str(tmp_path / "out"), **files) for a in argv]
    assert main(argv + ["--custom-module-map", str(tmp_path / "map.py")]) == 0
    captured = capsys.readouterr()
    assert "MarkedLlama" in captured.out + captured.err


def test_sampling_comes_from_the_checkpoint_unless_flags_say(tmp_path, capsys):
    path, _ = build_tiny_gguf(tmp_path, **{"general.sampling.temp": 0.0, "general.sampling.top_k": 5})
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "sampling: temperature=0.0 top_k=5 " in err and "max_tokens=2" in err
    assert "temperature, top_k from the checkpoint's generation config" in err
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2", "--temperature", "0.5"]) == 0
    err = capsys.readouterr().err
    assert "temperature=0.5 top_k=5 " in err and "(top_k from the checkpoint's" in err


def test_cli_without_flags_uses_the_model_defaults(files, capsys):
    assert main(["generate", files["gguf"], "--prompt", "hi", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "sampling: temperature=1.0 top_k=0 top_p=1.0 repetition_penalty=1.0 max_tokens=128" in err
    assert "the checkpoint recommends no sampling settings" in err


class _CharTokenizer:
    """One token per character of the rendered chat (enough to count what fits)."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 50 for c in text]


def test_fit_history_drops_whole_exchanges_oldest_first():
    tok = _CharTokenizer()
    turns = [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10},
             {"role": "user", "content": "c" * 10}, {"role": "assistant", "content": "d" * 10},
             {"role": "user", "content": "e" * 10}]
    full = len(tok.encode(tok.apply_chat_template(turns)))
    ids, dropped, room = cli._fit_history(tok, [], turns, full + 8, 8)
    assert (dropped, room, len(ids)) == (0, 8, full)
    ids, dropped, room = cli._fit_history(tok, [], turns, full + 7, 8)   # one token short: the oldest exchange goes
    assert dropped == 2 and room == 8 and len(ids) == len(tok.encode(tok.apply_chat_template(turns[2:])))
    last = len(tok.encode(tok.apply_chat_template(turns[4:])))
    ids, dropped, room = cli._fit_history(tok, [], turns, last + 3, 8)    # only the new turn fits: 3 tokens of room
    assert (dropped, room) == (4, 3)
    assert cli._fit_history(tok, [], turns, last, 8) is None              # not even one token of room


def test_chat_outgrowing_max_model_len_drops_old_turns_and_goes_on(files, capsys, monkeypatch):
    lines = ["tell me about the theme " * 3] * 5 + ["x " * 200, "bye"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", files["gguf"], "--max-model-len", "96", "--max-tokens", "8", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "[dropped the oldest" in err and "/reset clears the history" in err
    assert "[this message does not fit max_model_len=96" in err
    assert err.count(" pieces in ") == 6          # every turn but the one that cannot fit got an answer
