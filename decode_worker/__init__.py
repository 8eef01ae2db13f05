"""splitserve.decode_worker: orchestrates a request (reserve blocks, remote or local prefill) and decodes."""
