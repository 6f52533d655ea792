"""Model paths are sorted once (runtime/loaders/checkpoint.py) with errors that say what the path is;
check_model reports the tokenizer (a GGUF tokenizer that cannot be built is a problem, a HF
directory without tokenizer.json a note)."""
import pytest

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from graphdsl.models import check_model
from graphdsl.runtime.loaders.checkpoint import CheckpointFormat, checkpoint_format, has_tokenizer
from tests.models.gguf_tiny import build_tiny_gguf
from tests.models.hf_tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", d)
    return d


def test_formats(ckpt, tmp_path):
    assert checkpoint_format(ckpt) is CheckpointFormat.HF_DIR
    gguf, _ = build_tiny_gguf(tmp_path)
    assert checkpoint_format(gguf) is CheckpointFormat.GGUF
    renamed = tmp_path / "model.bin"                    # a GGUF by its magic, whatever its name
    renamed.write_bytes(gguf.read_bytes()[:64])
    assert checkpoint_format(renamed) is CheckpointFormat.GGUF


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "'{p}' not found: give a HF model directory"),
    (lambda d: d / "missing.gguf", "'{p}' not found"),
    (lambda d: d, "is a directory without config.json (it holds: nothing)"),
    (lambda d: d / "model.safetensors", "is one file of a HF checkpoint: give its directory '{d}'"),
    (lambda d: d / "config.json", "is one file of a HF checkpoint: give its directory '{d}'"),
    (lambda d: d / "notes.txt", "is neither a directory nor a GGUF file"),
])
def test_bad_paths_say_what_the_path_is(tmp_path, make, message):
    d = tmp_path / "m"
    d.mkdir()
    p = make(d)
    if p.suffix in (".safetensors", ".json", ".txt"):
        p.write_bytes(b"\xff\xfe not text")
    want = message.format(p=p, d=d)
    for call in (checkpoint_format, check_model, lambda x: gd.LLM(x, device="cpu")):
        with pytest.raises(GraphDSLError) as e:
            call(str(p))
        assert want in str(e.value) and "codec" not in str(e.value)


def test_empty_path():
    with pytest.raises(GraphDSLError, match="model path is empty"):
        checkpoint_format("")


def test_check_notes_a_missing_tokenizer(ckpt, tmp_path):
    assert not has_tokenizer(ckpt)
    report = check_model(ckpt)
    assert report.ok and report.notes
    assert "no tokenizer.json" in str(report) and "graphdsl generate and chat commands need one" in str(report)


def test_check_reports_a_gguf_tokenizer_that_cannot_be_built(tmp_path):
    good, _ = build_tiny_gguf(tmp_path / "good")
    assert has_tokenizer(good) and check_model(good).ok and not check_model(good).notes
    bad, _ = build_tiny_gguf(tmp_path / "bad", tokenizer_model="no-such-model")
    report = check_model(bad)
    assert not report.ok and "tokenizer: " in str(report) and "tokenizer.ggml.model is 'no-such-model'" in str(report)
