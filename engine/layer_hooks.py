"""The native engine's per-layer hook point: how its KV transfer (and anything else that must see each layer's
KV as it is written) rides along a step. A native-engine internal: no role sees it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from splitserve.engine.scheduler import ScheduledRequest


class KVLayerHook(Protocol):
    """A consumer of each step's KV writes (the KV streamer of a prefill worker, a KV pool writer, ...).

    Every hook's `on_step_begin` runs before the forward pass; it returns True when it wants
    `on_layer_written(i)` for this step (which then runs eagerly, not as a CUDA graph). On CUDA a layer's write
    is queued on the current stream, so a hook that hands the memory to another stream or agent records a CUDA
    event and waits on it before reading. Hooks run on the engine thread and must not block.

    Under tensor parallelism each rank holds a shard of the KV heads, so a hook must also say what the other
    ranks do in the step: `rank_plan()` (called after a True `on_step_begin`) returns ints that travel with
    the step to every follower's KV connector (`parallel.rank_connector`); hooks without it are refused.
    """

    def on_step_begin(self, scheduled: list[ScheduledRequest]) -> bool: ...

    def on_layer_written(self, layer_idx: int) -> None: ...

    def on_step_end(self, scheduled: list[ScheduledRequest]) -> None: ...
