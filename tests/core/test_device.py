"""Device arguments are checked in one place (graphdsl.runtime.device.check_device), up front, by
LLM, LLM.from_config, build_engine and the CLI; errors name the value and what this machine has.
An LLM on an indexed GPU makes it current around its work (kernels launch on the current device)."""
import pytest
import torch

from graphdsl import GraphDSLError, Network, Tensor
from graphdsl.runtime.device import check_device, default_device, machine_devices

BAD = ["tpu", "gpu", "cuda:abc", "", "CPU", " cpu", "cuda:-1", "cuda:0:1", "mps", "meta"]


@pytest.mark.parametrize("value", BAD)
def test_bad_strings_name_the_value_and_the_machine(value):
    with pytest.raises(GraphDSLError) as e:
        check_device(value, "build_engine: device")
    msg = str(e.value)
    assert f"build_engine: device={value!r}" in msg and "this machine has: cpu" in msg


def test_good_values():
    assert check_device(None) is None
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")
    assert default_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_wrong_types():
    for value in (1.5, True, ["cpu"]):
        with pytest.raises(GraphDSLError, match="must be a string"):
            check_device(value)
    with pytest.raises(GraphDSLError, match="must be >= 0"):
        check_device(-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's message")
def test_cuda_without_cuda_says_so():
    for value in ("cuda", "cuda:0", torch.device("cuda"), 0):
        with pytest.raises(GraphDSLError, match=r"needs CUDA, but this machine has: cpu only") as e:
            check_device(value, "--device")
        assert "use 'cpu'" in str(e.value)
    assert "built without CUDA" in machine_devices() or "no GPU is visible" in machine_devices()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_past_the_last_gpu():
    n = torch.cuda.device_count()
    with pytest.raises(GraphDSLError, match=f"no CUDA device {n}"):
        check_device(f"cuda:{n}")


def _net():
    net = Network("d")
    with net:
        net.mark_output(Tensor("x", (2,), "float32") * 2.0, "y")
    return net


@pytest.mark.parametrize("value", ["tpu", "cuda:abc", ""])
def test_build_engine_checks_the_device_before_building(value):
    with pytest.raises(GraphDSLError, match=r"build_engine: device="):
        _net().build_engine(device=value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_build_engine_for_cuda_fails_at_build_not_forward():
    with pytest.raises(GraphDSLError, match="needs CUDA"):
        _net().build_engine(device="cuda")


@pytest.mark.parametrize("value", ["tpu", "gpu", "cuda:abc", ""])
def test_llm_checks_the_device_before_reading_the_checkpoint(value, tmp_path):
    import graphdsl as gd
    with pytest.raises(GraphDSLError, match=r"LLM: device="):
        gd.LLM(tmp_path / "does-not-exist", device=value)       # the device error comes first
    with pytest.raises(GraphDSLError, match=r"LLM.from_config: device="):
        gd.LLM.from_config({"model_type": "llama"}, device=value)


def test_each_step_of_generate_runs_with_the_llms_gpu_current(monkeypatch):
    """Kernels launch on the current device: an LLM on ``cuda:1`` makes it current around each step
    of its loop and the final drain, and gives it back after each."""
    import contextlib

    from graphdsl.entrypoints import llm as llm_mod
    state = {"inside": 0}
    seen = []

    @contextlib.contextmanager
    def on_device(dev):
        state["inside"] += 1
        seen.append(dev)
        try:
            yield
        finally:
            state["inside"] -= 1

    class Loop:
        steps = 0

        def __init__(self, *a, **kw):
            pass

        def has_work(self):
            return Loop.steps < 2

        def step(self):
            assert state["inside"] == 1
            Loop.steps += 1
            return []

        def drain(self):
            assert state["inside"] == 1
            return []

    monkeypatch.setattr(llm_mod, "on_device", on_device)
    monkeypatch.setattr(llm_mod, "ServingLoop", Loop)
    llm = llm_mod.LLM.__new__(llm_mod.LLM)
    llm.tokenizer, llm._executor, llm.overlap, llm.device = None, None, True, torch.device("cuda", 1)
    llm.num_preemptions = llm.num_steps = 0
    monkeypatch.setattr(llm, "_scheduler", lambda: type("S", (), {"num_preemptions": 0})(), raising=False)
    Loop.num_steps = 0
    assert list(llm._run([])) == []
    assert seen == [torch.device("cuda", 1)] * 3 and state["inside"] == 0      # two steps and the drain


def test_on_device_switches_only_to_an_indexed_gpu():
    import contextlib

    from graphdsl.runtime.device import on_device
    assert isinstance(on_device(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(on_device(torch.device("cuda")), contextlib.nullcontext)     # the current one already
    guard = on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("TRUE", True), ("on", True), ("On", True),
                                       ("0", False), ("off", False), ("false", False), ("", False), ("yes", False)])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value, on):
    """Triton's switch takes 1/true/on in any case; graphdsl read it as ``== "1"`` in some modules
    and as "not 0" in others, so ``true`` or ``off`` split graphdsl's launches from Triton's @jit."""
    from graphdsl.runtime.device import triton_interprets
    from graphdsl.runtime.kernels.pdl import pdl_available
    from graphdsl.runtime.precompile import applies
    monkeypatch.setenv("TRITON_INTERPRET", value)
    monkeypatch.setenv("GRAPHDSL_COMPILE_WORKERS", "4")
    assert triton_interprets() is on
    if on:                  # (off, these go on to ask CUDA, which this CPU build of torch lacks)
        assert not applies("cuda") and not pdl_available("cuda")


def test_triton_interpret_has_one_reader():
    """Every module under the rooms asks runtime.device.triton_interprets, none reads the variable."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2]
    readers = [str(p.relative_to(root)) for room in ("graphdsl", "runtime", "entrypoints", "layers", "models", "passes")
               for p in (root / room).rglob("*.py")
               if re.search(r"environ(\.get)?[\[(]\s*['\"]TRITON_INTERPRET", p.read_text())]
    assert readers == ["runtime/device.py"]
