"""Device arguments are checked in one place (graphdsl.runtime.device.check_device), up front, by
LLM, LLM.from_config, build_engine and the CLI; errors name the value and what this machine has."""
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
