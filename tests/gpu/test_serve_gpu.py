"""``graphdsl serve`` on a GPU (run with ``pytest -m gpu``): by default the HTTP side runs in one API
process of its own; that process holds no CUDA context (it would cost each API process hundreds of
MB of GPU memory), and a completion through it is the one ``LLM.generate`` gives on the same GPU."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("uvicorn")

import graphdsl as gd  # noqa: E402
from tests.models.gguf_tiny import build_tiny_gguf  # noqa: E402
from tests.server.smollm2 import ServeInThread  # noqa: E402


def _cuda_pids() -> set[int] | None:
    """Pids of the processes holding a CUDA context (GPU memory), from ``nvidia-smi``; None where
    it cannot tell (no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(x) for x in out.split()}


def test_serve_on_cuda_starts_one_api_process_without_a_cuda_context(tmp_path, capsys, monkeypatch):
    import httpx
    gguf = str(build_tiny_gguf(tmp_path)[0])
    serve = ServeInThread(monkeypatch, [gguf, "--device", "cuda", "--max-model-len", "64", "--no-warmup"])
    with serve:
        body = {"model": os.path.basename(gguf), "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}
        out = httpx.post(f"{serve.base}/v1/completions", json=body, timeout=120)
        assert out.status_code == 200, out.text
        (procs,) = serve.started
        (proc,) = procs.processes                       # the default on CUDA: one API process
        pids = _cuda_pids()
    assert serve.close() == 0
    want = gd.LLM(gguf, device="cuda", max_model_len=64).generate(
        [[1, 2, 3]], gd.SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
    assert out.json()["choices"][0]["text"] == want
    assert "1 API process started" in capsys.readouterr().err
    if pids is None or os.getpid() not in pids:     # no nvidia-smi, or it shows pids of another namespace
        pytest.skip(f"nvidia-smi cannot say which processes hold a CUDA context here (it lists {pids})")
    assert proc.pid not in pids, (proc.pid, pids)
