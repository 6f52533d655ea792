"""Model tests run many tiny matmuls; on a shared 2-core box one intra-op thread is far faster."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
