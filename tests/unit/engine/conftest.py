"""The engine's unit tests compute in the test process, with one intra-op thread: `make test` runs two test
processes on a 2-core box, and two threads each made these tests 8% faster alone but cost 25% more CPU (OpenMP's
waiting threads spin), which the other process needed. Only while this package's tests run: every test process
imports this file when it collects, and the other packages keep torch's own setting."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
