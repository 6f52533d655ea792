"""What a model path is: a HF model directory or a GGUF file, decided once, with errors that say what
the path is instead (missing, a directory without ``config.json``, one file of a HF checkpoint).

``LLM``, ``check_model`` and the CLI all ask :func:`checkpoint_format` first, so a bad path gets the
same message everywhere and before anything is read.
"""
from __future__ import annotations

import enum
import os

from graphdsl.errors import GraphDSLError

__all__ = ["CheckpointFormat", "checkpoint_format", "has_tokenizer"]

_GGUF_MAGIC = b"GGUF"
_GIVE = "give a HF model directory (config.json + safetensors) or a .gguf file"


class CheckpointFormat(enum.Enum):
    HF_DIR = "HF model directory"
    GGUF = "GGUF file"


def checkpoint_format(path: str | os.PathLike) -> CheckpointFormat:
    """The format of the checkpoint at ``path``; raises :class:`GraphDSLError` naming what is wrong.

    A directory must hold ``config.json``. A file is GGUF when it starts with the GGUF magic or is
    named ``*.gguf`` (a bad one is then reported by the GGUF reader); a safetensors or JSON file of a
    HF checkpoint is answered with its directory.
    """
    path = os.fspath(path)
    if not path:
        raise GraphDSLError(f"model path is empty: {_GIVE}")
    if not os.path.exists(path):
        raise GraphDSLError(f"model path {path!r} not found: {_GIVE}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            present = sorted(os.listdir(path))
            shown = ", ".join(present[:8]) + (f", ... ({len(present)} entries)" if len(present) > 8 else "")
            raise GraphDSLError(f"{path!r} is a directory without config.json (it holds: {shown or 'nothing'}): "
                                f"{_GIVE}")
        return CheckpointFormat.HF_DIR
    if _starts_with_gguf_magic(path) or path.endswith(".gguf"):
        return CheckpointFormat.GGUF
    name, folder = os.path.basename(path), os.path.dirname(os.path.abspath(path))
    if name.endswith((".safetensors", ".json", ".bin")):
        raise GraphDSLError(f"{path!r} is one file of a HF checkpoint: give its directory {folder!r}")
    raise GraphDSLError(f"{path!r} is neither a directory nor a GGUF file: {_GIVE}")


def has_tokenizer(path: str | os.PathLike, fmt: CheckpointFormat | None = None, metadata: dict | None = None) -> bool:
    """Whether the checkpoint carries a tokenizer graphdsl reads: ``tokenizer.json`` beside a HF
    directory's config, or ``tokenizer.ggml.tokens`` in a GGUF file's metadata (pass ``metadata``
    when the file is already open)."""
    path = os.fspath(path)
    fmt = fmt or checkpoint_format(path)
    if fmt is CheckpointFormat.HF_DIR:
        return os.path.isfile(os.path.join(path, "tokenizer.json"))
    if metadata is None:
        from .gguf import GGUFCheckpoint
        metadata = GGUFCheckpoint(path).metadata
    return bool(metadata.get("tokenizer.ggml.tokens"))


def _starts_with_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False
