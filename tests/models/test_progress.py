"""Progress on stderr (loading weights, ``LLM.generate``): redrawn in place on a terminal, whole
lines (no carriage returns) when stderr is a pipe or a file."""
import io

import pytest

import graphdsl as gd
from graphdsl.runtime.progress import ProgressLine
from tests.models.gguf_tiny import build_tiny_gguf


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _show_three(stream, **kw):
    line = ProgressLine(stream, tty_every=0.0, plain_every=0.0, **kw)
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
    line = ProgressLine(io.StringIO())
    assert line.every == 10.0 and not line.due()


def test_llm_load_into_a_pipe_has_no_carriage_return(tmp_path, monkeypatch):
    path, _ = build_tiny_gguf(tmp_path)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    gd.LLM(path, device="cpu", progress=True)
    assert "loading weights:" in err.getvalue() and "\r" not in err.getvalue()


def test_progress_line_keeps_quick_work_silent():
    """Nothing is due before ``quiet_s``, and ``done(always=False)`` says nothing for work that never
    showed; shown once, the end is said."""
    out = io.StringIO()
    line = ProgressLine(out, tty_every=0.0, plain_every=0.0, quiet_s=60.0)
    assert not line.due()
    line.done("quick", always=False)
    assert out.getvalue() == ""
    line.show("slow")
    line.done("slow", always=False)
    assert [s.split(" ")[0] for s in out.getvalue().splitlines()] == ["slow", "slow"]


def _tiny_llm(tmp_path):
    path, _ = build_tiny_gguf(tmp_path)
    return gd.LLM(path, device="cpu")


def test_generate_progress_counts_prompts_when_all_their_samples_end(tmp_path, monkeypatch):
    """``generate``'s progress line (every event shown here) counts a prompt once all ``n`` of its
    samples have ended, adds its prompt tokens then, and counts every output token; into a pipe it
    has whole lines only."""
    from graphdsl.entrypoints import llm as llm_mod
    llm = _tiny_llm(tmp_path)
    seen = []

    class Every(llm_mod._GenerateProgress):
        def __init__(self, groups):
            super().__init__(groups)
            self.line = ProgressLine(err, tty_every=0.0, plain_every=0.0)
            seen.append(self)
    err = io.StringIO()
    monkeypatch.setattr(llm_mod, "_GenerateProgress", Every)
    prompts = [[1, 5, 9], [2, 6], [3, 7, 11, 13]]
    params = [gd.SamplingParams(max_tokens=m, n=n, temperature=0.0 if n == 1 else 0.7, seed=3, ignore_eos=True)
              for m, n in ((3, 1), (6, 2), (2, 1))]
    outs = llm.generate(prompts, params)
    p = seen[0]
    assert p.prompts == 3 and p.input_tokens == 9
    assert p.output_tokens == sum(len(c.token_ids) for o in outs for c in o.outputs) == 3 + 12 + 2
    text = err.getvalue()
    assert "\r" not in text
    counts = [int(s.split("Processed prompts: ")[1].split("/")[0]) for s in text.splitlines()]
    assert counts == sorted(counts) and counts[-1] == 3 and text.splitlines()[-1].split(")")[1].startswith(" in ")
    assert len(text.splitlines()) == p.output_tokens + 1            # one line an event, then the end


def test_generate_is_silent_when_quick_or_asked(tmp_path, capsys):
    llm = _tiny_llm(tmp_path)
    sp = gd.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], sp, use_tqdm=False)            # builds the engines
    capsys.readouterr()
    llm.generate([[1, 2, 3]], sp)
    assert capsys.readouterr().err == ""
    with pytest.raises(gd.GraphDSLError, match=r"use_tqdm must be a bool \(True or False\), got 'no'"):
        llm.generate([[1, 2, 3]], sp, use_tqdm="no")


def test_a_failing_generate_ends_its_progress_line_first(tmp_path, monkeypatch):
    """A step that raises ends the shown line (on a terminal, redrawn in place) before the error
    travels, so the traceback does not start on the progress line."""
    from graphdsl.entrypoints import llm as llm_mod
    llm = _tiny_llm(tmp_path)
    err = _Terminal()

    class Every(llm_mod._GenerateProgress):
        def __init__(self, groups):
            super().__init__(groups)
            self.line = ProgressLine(err, tty_every=0.0, plain_every=0.0)
    monkeypatch.setattr(llm_mod, "_GenerateProgress", Every)
    run = llm_mod.LLM._run

    def failing(self, groups):
        for k, ev in enumerate(run(self, groups)):
            if k == 2:
                raise RuntimeError("a step failed")
            yield ev
    monkeypatch.setattr(llm_mod.LLM, "_run", failing)
    with pytest.raises(RuntimeError, match="a step failed"):
        llm.generate([[1, 2, 3]], gd.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    text = err.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and "Processed prompts: 0/1" in text.rsplit("\r", 1)[1]
