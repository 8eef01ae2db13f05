"""splitserve.prefill_worker: see the package README for its role."""
