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

import logging
import os

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
