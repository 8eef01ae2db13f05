"""The engine's unit tests compute in the test process, with one intra-op thread: `make test` runs two test
processes on a 2-core box, and two threads each made these tests 8% faster alone but cost 25% more CPU (OpenMP's
waiting threads spin), which the other process needed."""

import torch

torch.set_num_threads(1)
