"""Loading progress on stderr: redrawn in place on a terminal, whole lines (no carriage returns)
when stderr is a pipe or a file."""
import io

import graphdsl as gd
from graphdsl.models import loader
from tests.models.gguf_tiny import build_tiny_gguf


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _show_three(stream, **kw):
    line = loader._ProgressLine(stream, tty_every=0.0, plain_every=0.0, **kw)
    for i in range(3):
        assert line.due()
        line.show(f"step {i}")
    line.done("3 steps")
    return stream.getvalue()


def test_plain_lines_when_not_a_terminal():
    text = _show_three(io.StringIO())
    assert "\r" not in text and "\033" not in text
    assert [s.split(" ")[:2] for s in text.splitlines()] == [["step", "0"], ["step", "1"], ["step", "2"], ["3", "steps"]]


def test_redrawn_in_place_on_a_terminal():
    text = _show_three(_Terminal())
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1


def test_plain_lines_are_rate_limited():
    line = loader._ProgressLine(io.StringIO())
    assert line.every == 10.0 and not line.due()


def test_llm_load_into_a_pipe_has_no_carriage_return(tmp_path, monkeypatch):
    path, _ = build_tiny_gguf(tmp_path)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    gd.LLM(path, device="cpu", progress=True)
    assert "loading weights:" in err.getvalue() and "\r" not in err.getvalue()
