"""splitserve.kv_transfer: see the package README for its role."""
