"""Device-specific kernels, chosen by device; the model files stay plain PyTorch."""
