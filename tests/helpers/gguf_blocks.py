"""Random GGUF weights as raw block bytes, for the GGUF kernel tests (CPU and GPU tiers).

Quantized with the ``gguf`` package where it can (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); the K formats, which gguf-py
cannot quantize, get random bytes with sane float16 super-block scales. Either way the reference
values come from ``gguf.quants.dequantize`` (numpy), independent of graphdsl.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["KERNEL_QTYPES", "random_gguf_weight", "random_gguf_blocks"]

KERNEL_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# byte offset of the float16 super-block scale fields of the K formats
_K_SCALES = {"Q4_0": (0, 2), "Q4_1": (0, 4), "Q8_0": (0, 2), "Q5_0": (0, 2), "Q5_1": (0, 4),
             "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210), "Q2_K": (80, 84), "Q3_K": (108, 110)}


def random_gguf_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data uint8 [n, row_bytes], w float32 [n, k])``: raw rows of a random ``[n, k]`` weight of
    GGML type ``qtype`` and their dequantized values according to gguf-py."""
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    q = Q[qtype]
    per, size = GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(seed)
    try:
        x = (rng.standard_normal((n, k)) * rng.uniform(0.02, 0.5, size=(n, 1))).astype(np.float32)
        data = np.ascontiguousarray(gguf.quants.quantize(x, q)).reshape(n, -1)
    except NotImplementedError:
        data = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
        lo, hi = _K_SCALES[qtype]
        data[:, :, lo:hi] = rng.uniform(-0.02, 0.02, size=(n, k // per, (hi - lo) // 2)).astype("<f2").view(np.uint8)
        data = data.reshape(n, -1)
    ref = gguf.quants.dequantize(data, q).reshape(n, k).astype(np.float32)
    return torch.from_numpy(data.copy()), torch.from_numpy(ref.copy())


def random_gguf_blocks(qtype: str, n: int, k: int, device="cuda", seed: int = 0) -> torch.Tensor:
    """Random raw rows ``uint8 [n, row_bytes]`` made on ``device`` (fast at real sizes): random
    bytes with the float16 scale fields set to small random values (so no inf/NaN)."""
    from graphdsl.runtime.gguf_blocks import GGUF_BLOCKS

    per, size = GGUF_BLOCKS[qtype]
    g = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, 256, (n, k // per, size), generator=g, device=device, dtype=torch.uint8)
    lo, hi = _K_SCALES[qtype]
    scales = (torch.rand(n, k // per, (hi - lo) // 2, generator=g, device=device) - 0.5) * 0.02
    data[:, :, lo:hi] = scales.to(torch.float16).view(torch.uint8)
    return data.reshape(n, -1)
