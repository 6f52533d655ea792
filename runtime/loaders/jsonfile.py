"""Reading the small JSON files that sit beside checkpoints (config, tokenizer and generation configs)."""
from __future__ import annotations

import json
import os

from graphdsl.errors import GraphDSLError

__all__ = ["read_json_object"]


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; unreadable, malformed or non-object files raise
    :class:`GraphDSLError` naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphDSLError(f"cannot read {os.fspath(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise GraphDSLError(f"{os.fspath(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data
