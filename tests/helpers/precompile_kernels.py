"""A Triton kernel for tests/kernels/test_precompile.py, importable by a worker process by name.
Import it with ``TRITON_INTERPRET`` unset: it must be a compiled ``JITFunction``, not the interpreter's."""
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    """``x[:n] += 1``."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)
