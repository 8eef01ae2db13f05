"""What splitserve runs inside vLLM's own processes, loaded by vLLM itself (a general plugin, KV connectors by
module path), never by the worker beside it. It imports only plain-Python splitserve modules (the worker's
packages, HTTP client and gRPC are not in a stock vLLM image; `connector_files` copies this closure there).

- Every vLLM process (API server, engine core, workers): `vllm_plugin` (entry point `vllm.general_plugins`),
  NIXL's progress thread paced on CPU hosts, inert unless the worker asks.
- Scheduler side (vLLM's engine core process): `pool_connector.SplitservePoolConnector` as the scheduler's
  connector, with its plain-Python planner `pool_plan.PoolPlanner` (what to load from the KV pool, what to
  store).
- Worker side (each of vLLM's model-runner processes): the same connector class as the worker's connector (the
  pool's reads before the forward, its writes after).
- Both sides, and the worker beside vLLM: `pool_plan`'s settings and Redis store (plain Python, no vLLM).
"""
