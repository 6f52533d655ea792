"""The one place a user's ``device`` argument is checked: ``LLM(device=)``, ``build_engine(device=)``
and the CLI's ``--device`` all go through :func:`check_device`.

graphdsl runs on ``"cpu"`` and on CUDA (``"cuda"``, ``"cuda:N"``, a ``torch.device`` of those, or an
int N meaning ``cuda:N`` as in torch). Anything else — a typo, another torch device type, a CUDA
device on a machine without one, an index past the last GPU — is a :class:`GraphDSLError` raised
before any work starts, naming the value and what this machine has.

:func:`triton_interprets` is the one reading of ``TRITON_INTERPRET`` (Triton's CPU interpreter, how CI
runs the kernels), parsed as Triton parses it.
"""
from __future__ import annotations

import contextlib
import os
import re

import torch

from graphdsl.errors import GraphDSLError

__all__ = ["check_device", "default_device", "machine_devices", "on_device", "triton_interprets"]

_FORMS = "'cpu', 'cuda' or 'cuda:N'"
_SPEC = re.compile(r"(cpu|cuda)(?::(\d+))?")


def triton_interprets() -> bool:
    """Whether Triton runs kernels on its CPU interpreter: ``TRITON_INTERPRET`` is ``1``, ``true`` or
    ``on`` in any case, the values Triton's own switch accepts (anything else, unset included, is off).
    Reading it any other way (``== "1"``, or "not 0") let ``true`` or ``off`` put graphdsl's launches
    on one side and Triton's ``@jit`` on the other. Triton decides per kernel when it is decorated, so
    the variable must be set before Triton is imported."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")


def default_device() -> torch.device:
    """CUDA when this machine has it, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(dev: torch.device):
    """Make ``dev`` the current CUDA device for a block; a no-op for the host and for ``cuda`` without
    an index (the current one). Triton kernels, CUDA graph captures and events go to the current
    device whatever their tensors' device, and each thread has its own: work for ``cuda:1`` launched
    while GPU 0 is current runs on GPU 0 over GPU 1's memory (wrong results through peer access, an
    illegal address without it)."""
    return torch.cuda.device(dev) if dev.type == "cuda" and dev.index is not None else contextlib.nullcontext()


def machine_devices() -> str:
    """What this machine offers, for error messages: ``"cpu, cuda:0 (NVIDIA H100)"`` or
    ``"cpu only (torch 2.13.0+cpu was built without CUDA)"``."""
    if torch.cuda.is_available():
        gpus = ", ".join(f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count()))
        return f"cpu, {gpus}"
    if torch.version.cuda is None:
        return f"cpu only (torch {torch.__version__} was built without CUDA)"
    return f"cpu only (torch {torch.__version__} has CUDA {torch.version.cuda}, but no GPU is visible)"


def check_device(device, what: str = "device") -> torch.device | None:
    """``device`` as a ``torch.device`` this machine can run on; None stays None (the caller's default).

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device`` of those, an int N (``cuda:N``),
            or None.
        what: how the caller's argument is called in the error (``"LLM: device"``, ``"--device"``).
    """
    if device is None:
        return None
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise GraphDSLError(f"{what}={device!r}: a CUDA index must be >= 0; this machine has: {machine_devices()}")
        dev = torch.device("cuda", device)
    elif isinstance(device, str):
        m = _SPEC.fullmatch(device)
        if m is None:
            raise GraphDSLError(f"{what}={device!r} is not a device graphdsl runs on: give {_FORMS}; "
                                f"this machine has: {machine_devices()}")
        dev = torch.device(m.group(1), int(m.group(2))) if m.group(2) is not None else torch.device(m.group(1))
    else:
        raise GraphDSLError(f"{what} must be a string ({_FORMS}), a torch.device or None, "
                            f"got {type(device).__name__} {device!r}")
    if dev.type not in ("cpu", "cuda"):
        raise GraphDSLError(f"{what}={str(dev)!r}: graphdsl runs on {_FORMS}, not on {dev.type!r}; "
                            f"this machine has: {machine_devices()}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GraphDSLError(f"{what}={str(dev)!r} needs CUDA, but this machine has: {machine_devices()}; "
                                "use 'cpu'")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise GraphDSLError(f"{what}={str(dev)!r}: there is no CUDA device {dev.index}; "
                                f"this machine has: {machine_devices()}")
    return dev
