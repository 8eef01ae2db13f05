"""What splitserve runs inside vLLM's own processes, loaded by vLLM itself (a general plugin, KV connectors by
module path), never by the worker beside it. It imports only plain-Python splitserve modules (the worker's
packages, HTTP client and gRPC are not in a stock vLLM image; `connector_files` copies this closure there).

- Every vLLM process (API server, engine core, workers): `vllm_plugin` (entry point `vllm.general_plugins`),
  NIXL's progress thread paced on CPU hosts, inert unless the worker asks.
- Scheduler side (vLLM's engine core process), each connector class in its scheduler role:
  `pool_connector.SplitservePoolConnector` with its planner `pool_plan.PoolPlanner` (what to load from the KV
  pool, what to store), and `layerwise_connector.SplitserveLayerwiseConnector` with its planner
  `layerwise_plan.LayerwisePlanner` (a decode server's reservations, a prefill server's steps), whose reservations
  go to the worker over `control_link`.
- Worker side (each of vLLM's model-runner processes), the same classes in their worker role: the pool's reads
  before the forward and writes after it; the layerwise connector's `layerwise_mover.LayerwiseMover` (a NIXL agent
  over the rank's KV cache: per-layer writes on a prefill server, notices on a decode server), `layerwise_peers`
  (the rank's KV as NIXL regions, its metadata served at the side channel, the decode peers it writes to) and
  `ucx_transport` (UCX's transport tables), on `control_link` too.
- Both sides, and the worker beside vLLM: `pool_plan`'s settings and Redis store, and `layerwise_wire`, every
  format the layerwise connector speaks (plain Python, no vLLM).
"""

import logging
import os
from typing import Any

LOG_LEVEL_ENV = "SPLITSERVE_VLLM_LOG_LEVEL"


def setup_logging() -> None:
    """Our loggers inside vLLM's processes: vLLM configures only its own, so ours get a stderr handler (once),
    at `SPLITSERVE_VLLM_LOG_LEVEL` (INFO by default)."""
    root = logging.getLogger("splitserve")
    if any(getattr(h, "_splitserve", False) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    handler._splitserve = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(f"(splitserve pid={os.getpid()}) %(levelname)s %(asctime)s "
                                           "[%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO").upper())
    root.propagate = False
    if root.level <= logging.DEBUG:  # a stuck connector's threads, on demand: kill -USR2 <pid>
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR2, all_threads=True)


def resumed_req_ids(cached: Any) -> set[str]:
    """Requests of a scheduler output's `scheduled_cached_reqs` resumed after a preemption (their new block ids
    replace the old): vLLM 0.32 lists them in a set, earlier versions flag them per request."""
    ids = getattr(cached, "resumed_req_ids", None)
    if ids is not None:
        return set(ids)
    flags = getattr(cached, "resumed_from_preemption", None) or []
    return {r for r, f in zip(cached.req_ids, flags, strict=False) if f}
