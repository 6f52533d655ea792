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
