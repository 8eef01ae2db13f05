"""splitserve.prefill_worker: computes prompts and streams their KV, layer by layer, into decode workers."""
