"""The ``GRAPHDSL_*`` environment variables: one table (``graphdsl/env.py``) that the code, the docs
and ``graphdsl env`` agree with; on/off switches read one way, a bad value named; a misspelt name
warned of."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphdsl.env import ENV_VARS, env_flag, env_number, unknown_env_vars, warn_unknown_env_vars
from graphdsl.errors import GraphDSLError

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("graphdsl", "passes", "runtime", "layers", "models", "entrypoints")


def _read_in_code() -> set[str]:
    names = set()
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            if path.name != "env.py":
                names |= set(re.findall(r"GRAPHDSL_[A-Z0-9_]+", path.read_text()))
    return names


def test_the_table_names_every_variable_the_code_reads_and_no_other():
    assert _read_in_code() == set(ENV_VARS)


def test_each_variable_is_explained_where_the_table_says():
    for name, var in ENV_VARS.items():
        assert name in (ROOT / var.doc).read_text(), f"{name} is not in {var.doc}"


def test_the_docs_table_is_the_table():
    text = (ROOT / "docs" / "debugging.md").read_text().split("<!-- env-table -->", 1)[1]
    rows = [line for line in text.strip().splitlines() if line.startswith("| `")]
    assert rows == [f"| `{n}` | {v.default} | {v.meaning} | {v.doc} |" for n, v in ENV_VARS.items()]


@pytest.mark.parametrize("raw, want", [("1", True), ("TRUE", True), (" on ", True), ("yes", True),
                                       ("0", False), ("False", False), ("off", False), ("NO", False)])
def test_a_switch_reads_the_usual_spellings(monkeypatch, raw, want):
    monkeypatch.setenv("GRAPHDSL_OVERLAP", raw)
    assert env_flag("GRAPHDSL_OVERLAP", not want) is want


def test_an_unset_or_empty_switch_is_its_default_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv("GRAPHDSL_PDL", raising=False)
    assert env_flag("GRAPHDSL_PDL", True) and not env_flag("GRAPHDSL_PDL", False)
    monkeypatch.setenv("GRAPHDSL_PDL", "")
    assert env_flag("GRAPHDSL_PDL", True)
    monkeypatch.setenv("GRAPHDSL_PDL", "disable")
    with pytest.raises(GraphDSLError, match=r"GRAPHDSL_PDL must be one of 1/true/on/yes \(on\) or "
                                            r"0/false/off/no \(off\), got 'disable'"):
        env_flag("GRAPHDSL_PDL", True)
    with pytest.raises(GraphDSLError, match="'GRAPHDSL_NOPE' is not a graphdsl environment variable"):
        env_flag("GRAPHDSL_NOPE", True)


def test_a_number_is_read_or_named(monkeypatch):
    """A bad number was a bare ValueError from deep in the collectives' setup."""
    from graphdsl.runtime.distributed.group import dist_timeout_s
    monkeypatch.delenv("GRAPHDSL_DIST_TIMEOUT_S", raising=False)
    assert dist_timeout_s() == 600.0
    monkeypatch.setenv("GRAPHDSL_DIST_TIMEOUT_S", " 90.5 ")
    assert dist_timeout_s() == 90.5
    for bad in ("10m", "0", "-5", "nan"):
        monkeypatch.setenv("GRAPHDSL_DIST_TIMEOUT_S", bad)
        with pytest.raises(GraphDSLError, match=rf"GRAPHDSL_DIST_TIMEOUT_S must be a number >= 1, got '{bad}'"):
            dist_timeout_s()
    monkeypatch.setenv("GRAPHDSL_ONESHOT_MAX_BYTES", "512K")
    with pytest.raises(GraphDSLError, match=r"GRAPHDSL_ONESHOT_MAX_BYTES must be an integer >= 0, got '512K'"):
        env_number("GRAPHDSL_ONESHOT_MAX_BYTES", 0, integer=True)
    monkeypatch.setenv("GRAPHDSL_ONESHOT_MAX_BYTES", "0")
    assert env_number("GRAPHDSL_ONESHOT_MAX_BYTES", 7, integer=True) == 0


def test_switches_that_used_to_ignore_a_spelling_now_take_it(monkeypatch):
    """``GRAPHDSL_TP_CUDA_GRAPHS=false`` was read as on (only ``0`` was off), and a misspelt
    ``GRAPHDSL_OVERLAP`` value left the overlap on without a word."""
    from graphdsl.entrypoints.tp_driver import tp_cuda_graphs_enabled
    monkeypatch.setenv("GRAPHDSL_TP_CUDA_GRAPHS", "false")
    assert not tp_cuda_graphs_enabled()
    monkeypatch.setenv("GRAPHDSL_OVERLAP", "of")
    from graphdsl.runtime.serving.loop import overlap_enabled
    with pytest.raises(GraphDSLError, match="GRAPHDSL_OVERLAP must be one of"):
        overlap_enabled(True)


def test_a_misspelt_name_is_found_with_the_name_meant(monkeypatch):
    env = {"GRAPHDSL_OVERLAPP": "0", "GRAPHDSL_CUDA_GRAPHS": "0", "GRAPHDSL_WHATEVER": "1",
           "GRAPHDSL_TEST_KNOB": "1", "PATH": "/bin"}
    assert unknown_env_vars(env) == [("GRAPHDSL_OVERLAPP", "GRAPHDSL_OVERLAP"), ("GRAPHDSL_WHATEVER", None)]
    import graphdsl.env as E
    monkeypatch.setattr(E, "_WARNED", set())
    monkeypatch.setenv("GRAPHDSL_CUDA_GRAPH", "0")
    with pytest.warns(UserWarning, match=r"GRAPHDSL_CUDA_GRAPH is set, but graphdsl reads no such environment "
                                         r"variable; did you mean GRAPHDSL_CUDA_GRAPHS\?"):
        warn_unknown_env_vars()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unknown_env_vars()                              # once a name, a process


def test_graphdsl_env_reports_versions_devices_and_settings(monkeypatch, capsys, tmp_path):
    from graphdsl.entrypoints.cli import main
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "fused_0.py").write_text("")
    monkeypatch.setenv("GRAPHDSL_CACHE_DIR", str(tmp_path / "engines"))
    monkeypatch.setenv("GRAPHDSL_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("GRAPHDSL_OVERLAP", "0")
    monkeypatch.setenv("GRAPHDSL_OVERLAPP", "0")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    import graphdsl
    import torch
    assert out.startswith(f"graphdsl {graphdsl.__version__} (")
    assert re.search(rf"^  torch +{re.escape(torch.__version__)}$", out, re.M)
    assert re.search(r"^  GRAPHDSL_OVERLAP +'0' +\(default 1\) 0: the serving loop", out, re.M)
    assert re.search(r"^  GRAPHDSL_PDL +- +\(default 1\)", out, re.M)
    assert "GRAPHDSL_OVERLAPP='0'  (did you mean GRAPHDSL_OVERLAP?)" in out
    assert "  NCCL_NVLS_ENABLE=0" in out
    assert ("CUDA GPUs: none visible" in out) != torch.cuda.is_available()
    assert f"engine cache: {tmp_path / 'engines'} (0 entries, 0.0 MiB;" in out
    assert f"kernel cache: {tmp_path / 'kernels'} (1 generated kernel file(s))" in out


def test_llm_warns_of_a_misspelt_name_at_the_users_line(tmp_path, monkeypatch):
    import graphdsl as gd
    import graphdsl.env as E
    from tests.models.hf_tiny import make_checkpoint
    make_checkpoint("llama", tmp_path / "m")
    monkeypatch.setattr(E, "_WARNED", set())
    monkeypatch.setenv("GRAPHDSL_CUDA_GRAPH", "0")
    with pytest.warns(UserWarning, match="did you mean GRAPHDSL_CUDA_GRAPHS") as seen:
        gd.LLM(str(tmp_path / "m"), device="cpu", num_kv_blocks=4)
    assert [w.filename for w in seen if "GRAPHDSL_CUDA_GRAPH " in str(w.message)] == [__file__]
