"""splitserve.decode_worker: see the package README for its role."""
