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


@pytest.mark.parametrize("scheme", [None, "int4-g128", "fp8-channel"])
def test_gemv_weight_prefetch_changes_no_bit(scheme, monkeypatch):
    """With PDL the one-row GEMV asks L2 for its first weight lines before the wait
    (``prefetch.global.L2`` in its PTX); its outputs are bit-identical with the prefetch off."""
    import graphdsl.runtime.kernels.gemv as G
    from graphdsl.quant import parse_scheme
    from graphdsl.runtime.kernels.pdl import pdl_available
    if not pdl_available(DEV):
        pytest.skip("the prefetch runs only with programmatic dependent launch (Hopper)")
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(6144, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    s = parse_scheme(scheme) if scheme else None
    stored = s.quantize(w, torch.bfloat16) if s else [w]
    x = torch.randn(1, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    kw = dict(scheme=s, scales=stored[1] if s else None, zeros=stored[2] if s and len(stored) > 2 else None)
    ws = G.GemvWorkspace()
    on = G.gemv(x, stored[0], workspace=ws, **kw)
    kind = G.weight_kind(s)
    cfg = G._pick_config(1, 6144, 4096, DEV) if s is None else G._pick_quant_config(1, 6144, 4096, kind, 128, DEV)
    assert G._prefetch_lines(kind, s is not None, cfg["BLOCK_K"], 4096) > 0
    assert any("prefetch.global.L2" in k.asm["ptx"] for k in _compiled(G._gemv_kernel))
    monkeypatch.setattr(G, "_PREFETCH_STEPS", 0)
    monkeypatch.setattr(G, "_PREFETCH_STEPS_QUANT", {})
    off = G.gemv(x, stored[0], workspace=ws, **kw)
    assert torch.equal(on, off)


def _compiled(jit_fn):
    """Every compiled variant of a ``@triton.jit`` function (the cache layout differs across Triton 3.x)."""
    out = []
    for per_device in jit_fn.device_caches.values() if hasattr(jit_fn, "device_caches") else [jit_fn.cache]:
        cache = per_device[0] if isinstance(per_device, tuple) else per_device
        out += [k for k in cache.values() if hasattr(k, "asm")]
    return out


@pytest.mark.parametrize("n,k", [(16384, 2048), (28672, 4096)])
@pytest.mark.parametrize("m", [17, 64, 65, 200, 256])
def test_swiglu_gemm_at_llama_shapes_matches_cublas_then_silu_mul(n, k, m):
    """The mid-batch gate/up GEMM with the SwiGLU epilogue (compiled, PDL on Hopper) against cuBLAS's
    product through the ``silu_mul`` kernel: the same roundings, so all but a few values agree
    bit for bit (the float32 sums run in another order)."""
    from graphdsl.runtime.codegen.ops import silu_mul
    from graphdsl.runtime.kernels.swiglu_gemm import swiglu_gemm
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    got = swiglu_gemm(x, w)
    want = silu_mul(x @ w.T)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.float().abs().max().item())
    assert (got == want).float().mean().item() > 0.95
