"""The benchmark scripts (``benchmarks/*.py``, not a package) imported by the tests that check them."""
import importlib.util
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` as a module of its own (a fresh import each call)."""
    spec = importlib.util.spec_from_file_location(f"graphdsl_bench_{name}_test", ROOT / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def exits_without_gpu(name: str, argv: list[str], capsys, monkeypatch) -> None:
    """``benchmarks/<name>.py``'s ``main(argv)`` on a machine without CUDA returns 2 and says it
    needs a CUDA GPU."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load(name).main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def refusal(name: str, argv: list[str], capsys) -> str:
    """What ``benchmarks/<name>.py``'s argument parser says on stderr when it refuses ``argv``
    (exit status 2, checked)."""
    import pytest
    with pytest.raises(SystemExit) as e:
        load(name).main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err
