"""Rooms and arrows (DESIGN.md): imports point one way; the package installs into one namespace."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_UP = ("graphdsl.entrypoints",)        # the user entry points: nothing below them imports them
FORBIDDEN = {
    "graphdsl": ("graphdsl.layers", "graphdsl.models", "graphdsl.passes", "graphdsl.runtime") + _UP,
    "passes": ("graphdsl.layers", "graphdsl.models", "graphdsl.runtime") + _UP,
    "layers": ("graphdsl.models", "graphdsl.runtime", "graphdsl.passes") + _UP,
    "runtime": ("graphdsl.layers", "graphdsl.models") + _UP,
    "models": _UP,
    # rooms inside runtime/: the engine core knows neither checkpoints nor serving; loaders know no serving
    "runtime/loaders": ("graphdsl.runtime.serving",),
    "runtime/backends": ("graphdsl.runtime.serving", "graphdsl.runtime.loaders"),
    "runtime/codegen": ("graphdsl.runtime.serving", "graphdsl.runtime.loaders"),
    "runtime/kernels": ("graphdsl.runtime.serving", "graphdsl.runtime.loaders"),
    "runtime/distributed": ("graphdsl.runtime.serving", "graphdsl.runtime.loaders"),
}
_CORE_FILES = sorted(p.name for p in (ROOT / "runtime").glob("*.py"))   # engine, build, cache, device, ...
# The language's documented seams: Network.build_engine calls the runtime builder, and the package
# root re-exports the public API (graphdsl.LLM etc.) lazily.
ALLOWED = {("graphdsl/network.py", "graphdsl.runtime.build"), ("graphdsl/__init__.py", "*"),
           ("graphdsl/__main__.py", "graphdsl.entrypoints.cli")}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_runtime_core_files_import_no_serving_or_loaders():
    bad = [f"runtime/{f} imports {mod}" for f in _CORE_FILES for mod in _imports(ROOT / "runtime" / f)
           if mod.startswith(("graphdsl.runtime.serving", "graphdsl.runtime.loaders"))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_imports_point_one_way(room):
    bad = []
    for path in (ROOT / room).rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for mod in _imports(path):
            if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[room]):
                if (rel, mod) not in ALLOWED and (rel, "*") not in ALLOWED:
                    bad.append(f"{rel} imports {mod}")
    assert not bad, "\n".join(bad)


def test_rooms_import_as_graphdsl_namespace():
    import graphdsl.entrypoints
    import graphdsl.layers
    import graphdsl.models
    import graphdsl.passes
    import graphdsl.runtime
    import graphdsl.runtime.loaders
    import graphdsl.runtime.serving
    for mod, folder in [(graphdsl.layers, "layers"), (graphdsl.models, "models"), (graphdsl.passes, "passes"),
                        (graphdsl.runtime, "runtime"), (graphdsl.entrypoints, "entrypoints"),
                        (graphdsl.runtime.loaders, "runtime/loaders"), (graphdsl.runtime.serving, "runtime/serving")]:
        assert pathlib.Path(mod.__file__).parent == ROOT / folder


def test_public_api_names():
    import graphdsl as gd
    for name in ["Tensor", "Dim", "Network", "get_default_net", "functional", "Module", "ModuleList", "Parameter",
                 "register_op", "OpCategory", "GraphDSLError"]:
        assert name in gd.__all__ and hasattr(gd, name)
