"""An asyncio face for the engine: `step()` runs in its own thread; requests stream outputs back.

It implements `ServingEngine` (what any role may use) and, for the native KV handover and KV pool only
(`kv_transfer`), the engine's own block-level calls: reserving and admitting remote KV, blocks in and out by
hash, held blocks, KV tensors and layer hooks. No role calls those.

Everything that touches the engine runs on that thread (commands are queued and run between steps, in order),
so the engine itself needs no locks. A caller cancelled while its command is still queued leaves no request
behind: an abort is queued after the command.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import torch

from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.worker_messages import RequestIdInUse
from splitserve.engine.interface import KVEventListener
from splitserve.engine.layer_hooks import KVLayerHook
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.parallel_link import RankLink

log = logging.getLogger("splitserve.engine.async")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.facts = engine.facts
        self.kv_spec = engine.kv_spec
        self.kv_shard = engine.kv_shard
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._stopped = False
        self.dead = False  # the engine cannot run steps any more (the worker should be restarted)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._snapshot: dict[str, int] = engine.stats()  # replaced (never mutated) by the engine thread
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            while self._commands:
                self._commands.popleft()()
            self._snapshot = self.engine.stats()
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # fail every request explicitly rather than hang them
                    log.exception("engine step failed")
                    self._fail_all(f"engine error: {e}")
                    if self.engine.parallel is not None:  # a tensor-parallel rank is gone: no step can run
                        self._stopped = True
                        self.dead = True
                    continue
                self._snapshot = self.engine.stats()  # before the outputs: a caller sees the step's effects
                for out in outputs:
                    self._deliver(out)
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def _fail_all(self, message: str) -> None:
        with self._lock:
            ids = list(self._queues)
        for rid in ids:
            try:  # a device that failed the step may fail this too (reading a step in flight): answer anyway
                self.engine.abort_request(rid)
            except Exception as e:
                log.warning("abort of %s after the failed step failed too: %s", rid, e)
            self._deliver(RequestOutput(rid, [], finished=True, finish_reason="error", error=message))

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            entry = self._queues.get(out.request_id)
            if entry is not None and out.finished:
                del self._queues[out.request_id]
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, out)

    # -- set-up (before requests flow) -----------------------------------------------------------------
    def kv_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.engine.kv_tensors()

    def follower_links(self) -> list[RankLink]:
        return self.engine.follower_links()

    def add_layer_hook(self, hook: KVLayerHook) -> None:
        self._commands.append(lambda: self.engine.add_layer_hook(hook))
        self._wake.set()

    def remove_layer_hook(self, hook: KVLayerHook) -> None:
        """Between two steps (a prefill role's hook goes when the worker flips to decode)."""
        self._commands.append(lambda: self.engine.remove_layer_hook(hook))
        self._wake.set()

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        self._commands.append(lambda: self.engine.add_kv_event_listener(listener))
        self._wake.set()

    # -- calls from asyncio -------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
                self._snapshot = self.engine.stats()  # what the caller did shows in stats at once
            except BaseException as e:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.append(run)
        self._wake.set()
        return await fut

    def _register(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise RequestIdInUse(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def _unregister(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       priority: int = 0, hold_blocks: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iterator early (or cancellation) aborts it."""
        queue = self._register(request_id)
        await self._call_for(request_id,
                             lambda e: e.add_request(request_id, prompt_token_ids, params, priority, hold_blocks))
        async for out in self._stream(request_id, queue):
            yield out

    async def _call_for(self, request_id: str, fn: Callable[[LLMEngine], T]) -> T:
        """`call` for a command that creates or admits `request_id`. If the command fails, nothing was created;
        if the caller is cancelled while it is queued, it may still run, so an abort is queued after it."""
        try:
            return await self.call(fn)
        except asyncio.CancelledError:
            self._abort_later(request_id)
            raise
        except BaseException:
            self._unregister(request_id)
            raise

    def _abort_later(self, request_id: str) -> None:
        """Stop streaming to `request_id` and abort it after every command queued so far (a cancelled
        `add_request` may still run: the abort follows it, so nothing is left holding blocks)."""
        self._unregister(request_id)
        self._commands.append(lambda: self.engine.abort_request(request_id))
        self._wake.set()

    async def _stream(self, request_id: str, queue: asyncio.Queue,
                      first: RequestOutput | None = None) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            if first is not None:
                yield first
            while True:
                out: RequestOutput = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._abort_later(request_id)

    async def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                             priority: int = 0, hold_blocks: bool = False) -> tuple[list[int], int] | None:
        """Blocks for a prompt whose KV arrives from outside: (block ids, prompt tokens cached here) or None."""
        return await self._call_for(request_id, lambda e: e.reserve_remote(request_id, prompt_token_ids, params,
                                                                           priority, hold_blocks))

    async def export_blocks(self, block_hashes: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        return await self.call(lambda e: e.export_blocks(block_hashes))

    async def stream_loaded(self, request_id: str, first_block: int, data: torch.Tensor) -> AsyncIterator[RequestOutput]:
        """Write KV loaded from outside into a reserved request's blocks from `first_block` on, admit it, and
        stream its outputs (the rest of its prompt is computed as usual)."""
        queue = self._register(request_id)
        await self._call_for(request_id, lambda e: e.load_blocks(request_id, first_block, data))
        async for out in self._stream(request_id, queue):
            yield out

    async def stream_remote(self, request_id: str, first_token_id: int,
                            first_logprob: Logprob | None = None) -> AsyncIterator[RequestOutput]:
        """Admit a request whose KV landed and stream its outputs, starting with the first token."""
        queue = self._register(request_id)
        first = await self._call_for(request_id, lambda e: e.admit_remote(request_id, first_token_id, first_logprob))
        if first.finished:
            self._unregister(request_id)
            yield first
            return
        async for out in self._stream(request_id, queue, first):
            yield out

    async def abort(self, request_id: str) -> None:
        self._unregister(request_id)
        await self.call(lambda e: e.abort_request(request_id))

    async def release(self, request_id: str) -> bool:
        return await self.call(lambda e: e.release(request_id))

    def stats(self) -> dict[str, int]:
        """The engine's counters as of its last step or command; never waits for the engine thread."""
        return self._snapshot

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.close()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
