import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: a tiny model gains nothing from two on a shared CPU."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
