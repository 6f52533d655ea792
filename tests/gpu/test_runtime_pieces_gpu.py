"""KV cache sizing and GGUF dequantization on a CUDA device (run with ``pytest -m gpu``): the
cache must size itself from the device's free memory; dequantization must match the CPU."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from graphdsl.runtime.loaders.gguf import dequantize
from graphdsl.runtime.serving.kv_cache import BlockManager, PagedKVCache

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")


def test_cache_sizing_from_free_memory():
    n = PagedKVCache.blocks_for_memory(0.05, 32, 8, 128, block_size=16, dtype=torch.bfloat16, device=DEV)
    per = PagedKVCache.bytes_per_block(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    free, _ = torch.cuda.mem_get_info(DEV)
    assert n >= 1 and n * per <= 0.05 * free + per
    cache = PagedKVCache(32, 8, 128, num_blocks=min(n, 256), block_size=16, dtype="bfloat16", device=DEV)
    assert cache.key_caches[0].is_cuda and cache.key_caches[0].shape == (min(n, 256), 16, 8, 128)
    m = BlockManager(cache.num_blocks, 16)
    m.allocate("s", 100)
    slots = torch.tensor(m.slot_mapping("s", 0, 100), device=DEV)
    flat = cache.key_caches[0].view(-1, 8, 128)
    flat[slots] = 1
    assert int(cache.key_caches[0].sum().item()) == 100 * 8 * 128


@pytest.mark.parametrize("name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                  "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_on_gpu_matches_cpu(name):
    """Same torch decoders on the GPU: bit-identical to the CPU result; prints GB/s of output."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    qtype = Q[name]
    per, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 4096, 14336
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // per * size), dtype=np.uint8)
    # sane float16 scale fields (random bytes can be inf/NaN, which compare unequal)
    blocks = raw.reshape(-1, size)
    scale_at = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
                "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
    for off in scale_at.get(name, []):
        blocks[:, off:off + 2] = rng.uniform(-1, 1, size=(blocks.shape[0], 1)).astype("<f2").view(np.uint8)
    if name in ("F16", "BF16"):
        raw = rng.standard_normal((rows, cols)).astype(np.float32).astype(np.float16).view(np.uint8) \
            if name == "F16" else raw
    cpu = dequantize(raw, qtype, (rows, cols))
    gpu = dequantize(raw, qtype, (rows, cols), device=DEV)
    assert gpu.is_cuda and gpu.dtype == torch.float32
    assert torch.equal(gpu.cpu().nan_to_num(), cpu.nan_to_num())
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dequantize(raw, qtype, (rows, cols), device=DEV)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 5 * 1e3
    print(f"\ndequantize {name} {rows}x{cols} on GPU (incl. H2D of the raw bytes): {ms:.2f} ms, "
          f"{rows * cols * 4 / ms / 1e6:.0f} GB/s of float32 out")
