"""splitserve.autoscaler: see the package README for its role."""
