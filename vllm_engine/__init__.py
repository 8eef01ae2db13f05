"""vLLM as an engine behind splitserve's control plane: a stock vLLM server beside each worker, driven over its
HTTP API, its KV events bridged into the cluster's index, its P/D handover vLLM's own pull (NixlConnector).
Imports no vLLM and no torch."""
