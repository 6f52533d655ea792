"""dtype names accepted by graphdsl: torch dtypes, or their short string names."""
from __future__ import annotations

import torch

from .errors import GraphDSLError

__all__ = ["to_dtype", "dtype_str", "DTYPES"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def to_dtype(x, what: str = "dtype") -> torch.dtype | None:
    """Normalise ``x`` (a torch dtype, a name like ``"bfloat16"``, or None) to a torch dtype."""
    if x is None or isinstance(x, torch.dtype):
        return x
    if isinstance(x, str):
        key = x.removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise GraphDSLError(f"{what} must be a torch.dtype or one of {sorted(set(DTYPES))}, got {x!r}")


def dtype_str(d: torch.dtype | None) -> str:
    return "?" if d is None else str(d).removeprefix("torch.")
