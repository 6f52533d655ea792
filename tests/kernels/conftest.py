"""tests/kernels: Triton kernels against their ops' torch references.

Without CUDA the kernels run under Triton's CPU interpreter, which triton picks when a kernel is
*decorated*, so ``TRITON_INTERPRET=1`` must be set before the kernel modules are imported: here,
before any test module of this folder is collected. With CUDA the same tests run compiled, at
real sizes.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
