"""Execution backends. A backend turns an optimised network plus a concrete shape plan into a list
of launches; ``torch`` runs every node's torch reference (CPU or CUDA); ``triton`` runs generated
fused kernels and cuBLAS matmuls (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

BACKENDS = {"torch": TorchBackend, "triton": TritonBackend}

__all__ = ["BACKENDS", "TorchBackend", "TritonBackend"]
