"""``one_thread``: a module fixture that runs torch on one thread (many tiny ops: torch's thread pool only adds
contention on a shared machine). A module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")`` and
``from tests.threads import one_thread``."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
