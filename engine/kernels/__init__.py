"""Device-specific kernels, chosen by device; the model files stay plain PyTorch."""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None
