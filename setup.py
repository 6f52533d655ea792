"""Package layout (DESIGN.md "Layout"): the sibling rooms install into the graphdsl namespace,
so users write ``from graphdsl.layers import RMSNorm`` and no generic top-level names are installed.
Sub-packages are found automatically; everything else is in pyproject.toml."""
from setuptools import find_packages, setup

ROOMS = {"graphdsl": "graphdsl", "graphdsl.entrypoints": "entrypoints", "graphdsl.layers": "layers",
         "graphdsl.models": "models", "graphdsl.passes": "passes", "graphdsl.runtime": "runtime"}

packages = []
for pkg, folder in ROOMS.items():
    packages.append(pkg)
    packages += [f"{pkg}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOMS)
