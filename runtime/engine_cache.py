"""On-disk cache of built engines (optimised graphs and generated kernel sources).

A build's result is keyed by everything that can change it: the recorded graph (its JSON, which
holds ops, attributes, shapes, dtypes and names — but no weights, which are bound later, so a
changed checkpoint reuses the plan), the build options (backend, pass configuration), the
versions of graphdsl, torch and triton, and the GPU architecture. Entries are JSON files written
atomically (temporary file + ``os.replace``), so a crashed or concurrent build never leaves a
half-written entry. Location: ``$GRAPHDSL_CACHE_DIR``, else ``~/.cache/graphdsl``.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphdsl.errors import GraphDSLError

__all__ = ["EngineCache", "CacheEntry", "default_cache_dir", "environment_key"]

FORMAT = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRAPHDSL_CACHE_DIR") or Path.home() / ".cache" / "graphdsl")


def environment_key(device=None) -> dict[str, str]:
    """Versions and GPU architecture that a cached build depends on."""
    import graphdsl
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    dev = torch.device(device) if device is not None else None
    arch = "cpu"
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(dev)
        arch = f"sm_{major}{minor}"
    return {"graphdsl": graphdsl.__version__, "torch": torch.__version__, "triton": triton_version, "arch": arch}


@dataclass
class CacheEntry:
    key: str
    path: Path
    name: str
    size: int
    created: float


class EngineCache:
    """A directory of cached builds: ``key(...)`` → ``get``/``put``; ``entries``/``clear``."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.dir = Path(directory) if directory is not None else default_cache_dir()

    @staticmethod
    def key(graph_json: dict, options: dict[str, Any], environment: dict[str, str]) -> str:
        """sha256 over the canonical JSON of (graph, options, environment)."""
        blob = json.dumps({"format": FORMAT, "graph": graph_json, "options": options, "env": environment},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise GraphDSLError(f"engine cache key must be a sha256 hex digest, got {key!r}")
        return self.dir / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The cached payload, or None when absent or unreadable (a corrupt entry is removed)."""
        path = self._path(key)
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            return None
        if obj.get("format") != FORMAT or obj.get("key") != key:
            return None
        return obj["payload"]

    def put(self, key: str, payload: dict, *, name: str = "") -> Path:
        """Store ``payload`` (JSON-serialisable) atomically; returns the entry's path."""
        path = self._path(key)
        self.dir.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"format": FORMAT, "key": key, "name": name, "created": time.time(), "payload": payload})
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def remove(self, key: str) -> bool:
        """Delete one entry; returns whether it existed."""
        path = self._path(key)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed

    def entries(self) -> list[CacheEntry]:
        out = []
        for p in sorted(self.dir.glob("*.json")) if self.dir.exists() else []:
            try:
                head = json.loads(p.read_text())
                out.append(CacheEntry(p.stem, p, head.get("name", ""), p.stat().st_size, head.get("created", 0.0)))
            except (OSError, ValueError):
                out.append(CacheEntry(p.stem, p, "<corrupt>", p.stat().st_size, 0.0))
        return out

    def clear(self) -> int:
        """Delete every entry; returns how many were removed."""
        n = 0
        for p in list(self.dir.glob("*.json")) if self.dir.exists() else []:
            p.unlink(missing_ok=True)
            n += 1
        return n
