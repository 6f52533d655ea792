"""graphdsl.runtime.kernels — hand-written Triton kernels (one op per file, named after the op)."""
from .cache_write import reshape_and_cache
from .paged_attention import paged_attention, paged_attention_decode, paged_attention_prefill

__all__ = ["reshape_and_cache", "paged_attention", "paged_attention_prefill", "paged_attention_decode"]
