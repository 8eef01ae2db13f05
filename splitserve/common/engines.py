"""The engines a worker can run, chosen by name (`engine`, `<role>.engine.kind`) in this one place: for each, the
plain facts that set it apart (what it takes from the configuration, what its processes and pods need) and the
dotted paths of its heavier parts (how a worker loads it, the handover sides each role assembles), imported only
when that engine is chosen. Callers ask `get(kind)` and never compare an engine's name.

This module is the bottom layer's (no torch, no engine code): the configuration model checks a cluster against
it, the hosts read its facts, and a worker resolves its paths (`load`, `handovers`) where it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from splitserve.common.config import ClusterSpec

EngineKind = Literal["native", "vllm"]
DEFAULT_ENGINE: EngineKind = "native"


@dataclass(frozen=True)
class Engine:
    """One engine kind: its facts and where its parts live."""

    name: str
    load: str
    """`module:function`, `async (spec, role, advertise_host, attach_url, stop) -> ServingEngine`: the worker's
    engine, loaded (and started) for its role."""
    handovers: str
    """A module whose `prefill_side(spec, engine, ctx) -> PrefillHandover`, `decode_side(spec, engine, ctx)` and
    `colocated_side(spec, engine, ctx) -> DecodeSide` assemble what each role's service runs on this engine."""
    check: Callable[[ClusterSpec, tuple[str, ...]], None]
    """Raises ValueError, naming the field, for what this engine cannot honour on `roles` (its workers' roles)."""
    takes_threads: bool
    """The worker sets its CPU threads from `engine.threads` (hosts share the cores out); else the engine picks
    its own."""
    shards_handover: bool
    """Its handover streams KV between tensor-parallel (sharded) prefill and decode workers."""
    pod_server: str | None
    """`module:function`, `(resource, role, role_spec, resources) -> PodServer` (`hosts.k8s.pods`): the engine as
    a server beside the worker, a container of its pod, which the worker attaches to (`--vllm-url`). None: the
    engine runs inside the worker process."""
    process_env: str | None
    """`module:function`, `(spec, role, slot, slots) -> dict | None`: environment a host gives the `slot`-th of
    `slots` worker processes it starts on one machine (None: nothing)."""
    connector: Callable[[ClusterSpec], str]
    """The KV connector a disaggregated worker reports in its health ("": the engine's own handover)."""

    @property
    def server_beside(self) -> bool:
        """It is a server beside the worker (a pod's container, or locally the worker's child): the worker can
        attach to one already serving, and its load sees the worker's stop and stops the server it started."""
        return self.pod_server is not None

    def resolve_pod_server(self) -> Callable[..., Any] | None:
        """The function `pod_server` names, imported now (None: no server beside the worker)."""
        return None if self.pod_server is None else _resolve(self.pod_server)

    def resolve_load(self) -> Callable[..., Any]:
        """The coroutine function `load` names, imported now."""
        return _resolve(self.load)

    def resolve_handovers(self) -> ModuleType:
        """The module `handovers` names, imported now."""
        return _resolve(self.handovers)

    def resolve_process_env(self) -> Callable[..., dict[str, str] | None] | None:
        """The function `process_env` names, imported now (None: the engine needs none)."""
        return None if self.process_env is None else _resolve(self.process_env)


def _resolve(path: str) -> Any:
    """The object a `module:attr` path (or a module path) names, imported now."""
    module, _, attr = path.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded


def _check_native(spec: ClusterSpec, roles: tuple[str, ...]) -> None:
    for r in roles:
        if spec.role(r).engine.data_parallel_size > 1:
            raise ValueError(f"{r}.engine.dataParallelSize: engine native runs one engine per worker; add "
                             f"replicas instead (or use engine vllm)")


def _check_vllm(spec: ClusterSpec, roles: tuple[str, ...]) -> None:
    if spec.kv_pool.enabled and spec.model.tensor_parallel_size > 1:
        raise ValueError(f"model.tensorParallelSize: the KV pool stores unsharded blocks only (got "
                         f"{spec.model.tensor_parallel_size} with kvPool.enabled and engine vllm); set "
                         f"kvPool.enabled false or tensorParallelSize 1")
    if spec.model.load_format == "dummy" and spec.model.tokenizer:
        raise ValueError("model.tokenizer: engine vllm loads the tokenizer from the model directory; a "
                         "separate tokenizer with dummy weights is native only")
    if spec.model.name.endswith(".gguf"):
        raise ValueError("model.name: engine vllm serves Hugging Face model directories, not .gguf files")
    if "block_size" not in spec.model.model_fields_set:
        # vLLM's CPU attention needs 32-token blocks; 32 suits its GPU backends as well
        spec.model.__dict__["block_size"] = 32
    elif spec.model.device == "cpu" and spec.model.block_size != 32:
        raise ValueError(f"model.blockSize: vLLM on CPU needs 32-token KV blocks (got {spec.model.block_size})")
    for r in roles:
        if spec.role(r).engine.max_prefill_tokens_while_decoding:
            raise ValueError(f"{r}.engine.maxPrefillTokensWhileDecoding: engine native only (vLLM chunks prompts "
                             f"under maxNumBatchedTokens and longPrefillTokenThreshold); leave it at 0")
        if spec.role(r).engine.threads:
            raise ValueError(f"{r}.engine.threads: engine vllm picks its own CPU threads (VLLM_CPU_OMP_THREADS_BIND "
                             f"in the worker's environment); leave threads at 0")
        if spec.role(r).engine.batch_invariant and spec.model.device == "cpu":
            raise ValueError(f"{r}.engine.batchInvariant: vLLM's batch-invariant mode runs on GPUs only (on CPU "
                             f"its overrides are Triton kernels); use engine native on CPU")


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("native", load="splitserve.kv_transfer.native:load", handovers="splitserve.kv_transfer.native",
           check=_check_native, takes_threads=True, shards_handover=False,
           pod_server=None, process_env=None, connector=lambda spec: ""),
    Engine("vllm", load="splitserve.vllm_engine.launch:launch", handovers="splitserve.vllm_engine.handovers",
           check=_check_vllm, takes_threads=False, shards_handover=True,
           pod_server="splitserve.hosts.k8s.pods:vllm_pod_server",
           process_env="splitserve.vllm_engine.server:process_env",
           connector=lambda spec: spec.vllm.connector),
)}


def get(kind: str) -> Engine:
    """The engine named `kind`; a ValueError naming the field when there is none."""
    try:
        return ENGINES[kind]
    except KeyError:
        raise ValueError(f"engine: unknown engine {kind!r} (one of {', '.join(ENGINES)})") from None


def attaching() -> list[str]:
    """The engines whose server a worker can attach to (`--vllm-url`)."""
    return [name for name, e in ENGINES.items() if e.server_beside]
