"""Execution backends. A backend turns an optimised network plus a concrete shape plan into a list
of launches; ``torch`` runs every node's torch reference (CPU or CUDA)."""
from .torch_backend import TorchBackend

BACKENDS = {"torch": TorchBackend}

__all__ = ["BACKENDS", "TorchBackend"]
