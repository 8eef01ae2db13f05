"""The KV connectors engine vllm runs between disaggregated workers, chosen by name in one place
(`vllm.connector`): what each puts in the vLLM server's `--kv-transfer-config`, whether the worker keeps a control
line to it, and which handover pair the worker runs beside it (built by `handovers`: the operator renders pods
from this module and never imports a handover).

- `layerwise`: ours (`in_vllm.layerwise_connector`): the decode server reserves the prompt's blocks first, the
  prefill server writes each layer into them over NIXL while it computes (`layerwise_handover`).
- `push`: vLLM's `NixlPushConnector`: the prefill server computes the whole prompt, then writes it into blocks the
  decode server registered with it once the request reached it (`pull_handover`'s receipt starts that).
- `pull`: vLLM's `NixlConnector`: the decode server reads the prompt's blocks once the prefill ended
  (`pull_handover`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.common.config import ClusterSpec
from splitserve.vllm_engine.in_vllm.layerwise_wire import LayerwiseSettings

LAYERWISE_MODULE = "splitserve.vllm_engine.in_vllm.layerwise_connector"
LAYER_GROUP_ENV = "SPLITSERVE_VLLM_LAYER_GROUP"  # a measurement knob: layers per NIXL write (default 1)


@dataclass(frozen=True)
class Connector:
    name: str
    entry: Callable[[ClusterSpec, bool, int], dict[str, Any]]  # (spec, on CPU, control port) -> a connector entry
    control: bool  # the worker keeps a control line to it (`control.ControlServer`)
    handover: str  # which handover pair: layerwise | pull


def _nixl(kind: str) -> Callable[[ClusterSpec, bool, int], dict[str, Any]]:
    def entry(spec: ClusterSpec, cpu: bool, control_port: int) -> dict[str, Any]:
        return {"kv_connector": kind, "kv_role": "kv_both", "kv_buffer_device": "cpu" if cpu else "cuda"}
    return entry


def _layerwise(spec: ClusterSpec, cpu: bool, control_port: int) -> dict[str, Any]:
    import os

    settings = LayerwiseSettings(f"tcp://127.0.0.1:{control_port}", layer_group=int(os.environ.get(
        LAYER_GROUP_ENV, "1")), ticket_wait_seconds=spec.kv_transfer.timeout_seconds)
    return {"kv_connector": "SplitserveLayerwiseConnector", "kv_role": "kv_both",
            "kv_connector_module_path": LAYERWISE_MODULE, "kv_connector_extra_config": settings.to_extra()}


CONNECTORS = {c.name: c for c in (
    Connector("layerwise", _layerwise, control=True, handover="layerwise"),
    Connector("push", _nixl("NixlPushConnector"), control=False, handover="pull"),
    Connector("pull", _nixl("NixlConnector"), control=False, handover="pull"),
)}


def connector(spec: ClusterSpec) -> Connector:
    return CONNECTORS[spec.vllm.connector]
