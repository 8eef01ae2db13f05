"""What the serving roles may use of the engine, and nothing more: model facts, the KV layout, reserving and
admitting remote KV, KV blocks in and out by hash (the KV pool), the KV block events, and per-layer hooks (any
number of consumers).

`AsyncEngine` implements `ServingEngine`; the prefill and decode services are written against this protocol,
so they never reach into the engine's runner, scheduler or cache tensors by attribute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.engine.block_pool import KVCacheEvent
from splitserve.engine.config import KVCacheSpec
from splitserve.engine.outputs import RequestOutput

if TYPE_CHECKING:
    import torch

    from splitserve.engine.parallel import KVShard
    from splitserve.engine.parallel_link import RankLink
    from splitserve.engine.scheduler import ScheduledRequest


@dataclass(frozen=True)
class ModelFacts:
    """The served model as the roles see it."""

    name: str  # the served model name; also the salt of its block hashes
    vocab_size: int
    max_model_len: int  # tokens (prompt + output)
    eos_token_ids: frozenset[int]
    tensor_parallel_size: int
    device: str  # cpu | cuda:N


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


KVEventListener = Callable[[KVCacheEvent], None]


class ServingEngine(Protocol):
    """The engine as a prefill or decode service uses it (everything async runs on the service's loop)."""

    facts: ModelFacts
    kv_spec: KVCacheSpec
    kv_shard: KVShard  # which KV heads rank 0 (this process) holds, of how many, over how many ranks
    dead: bool  # no step can run any more (the worker should be restarted)

    def kv_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]: what transfer agents register."""
        ...

    def follower_links(self) -> list[RankLink]:
        """Under tensor parallelism, message links to ranks 1..N-1 (their KV connectors); else empty."""
        ...

    def add_layer_hook(self, hook: KVLayerHook) -> None: ...

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        """Called on the engine thread with every BlockStored / BlockRemoved / AllBlocksCleared; must not block."""
        ...

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 priority: int = 0, hold_blocks: bool = False) -> AsyncIterator[RequestOutput]: ...

    async def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                             priority: int = 0, hold_blocks: bool = False) -> tuple[list[int], int] | None: ...

    async def export_blocks(self, block_hashes: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """Copies of cached blocks by hash (those still cached), as bytes: [n, bytes per block]."""
        ...

    def stream_loaded(self, request_id: str, first_block: int,
                      data: torch.Tensor) -> AsyncIterator[RequestOutput]:
        """Write loaded KV into a reserved request's blocks from `first_block`, admit it, stream its outputs."""
        ...

    def stream_remote(self, request_id: str, first_token_id: int,
                      first_logprob: Logprob | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def release(self, request_id: str) -> bool: ...

    def stats(self) -> dict[str, int]:
        """Counters as of the engine's last step (never waits for a step to end)."""
        ...

    def shutdown(self) -> None: ...
