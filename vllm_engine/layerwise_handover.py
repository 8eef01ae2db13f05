"""The KV handover seam for vLLM workers with the layer-wise push connector (`vllm.connector: layerwise`).

Decode side: `reserve` starts the request on this worker's vLLM server at once, with `consumer` params: vLLM
allocates its blocks and parks it (`WAITING_FOR_REMOTE_KVS`) while the connector inside it publishes the blocks
(`reserved`, on the control line); they become the ticket. Meanwhile the prefill call is already out
(`overlap_reserve`) and the ticket follows it. `landed` waits for the connector's word that the KV is in place, or
that it was not (then vLLM recomputes the prompt itself, `kv_load_failure_policy: recompute`, and the request goes
on); `admit` streams the request that has been running all along, whose first token the decode server samples
(`streams_first_token`). `cancel` aborts it; vLLM keeps its blocks until the connector says no write can land any
more (the sender's last word, or the ticket's deadline), or at once when the ticket was never published.

Prefill side: `run` starts the prompt on this worker's vLLM server with `producer` params before the ticket is in;
when it comes it goes to the connector's ranks, which write each layer into the decode server's blocks as the
forward goes on (layers computed before it go at once). The reply waits for the connector's word that the writes
ended: a transfer that failed is logged and counted, not an error (the decode server recomputes the prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client import Counter

from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.worker_client import WorkerCallError
from splitserve.engine.interface import BadTicket, HandoverFailed, PrefillResult, Reservation
from splitserve.engine.outputs import RequestOutput
from splitserve.vllm_engine.control import ControlServer
from splitserve.vllm_engine.engine import VllmEngine
from splitserve.vllm_engine.in_vllm.layerwise_wire import LayerwiseTicket, WireError, now, request_params
from splitserve.vllm_engine.wire import VllmProtocolError

log = logging.getLogger("splitserve.vllm")

LAYERWISE = Counter("splitserve_vllm_layerwise_total", "Layer-wise KV handovers of engine vllm by how they ended "
                    "(landed, recompute: the decode server recomputed the prompt; send_failed: a prefill's writes)",
                    ["outcome"])
GRACE_S = 5.0  # past a ticket's deadline, for the connector's word to come
_UNSAFE = re.compile(r"[^\x21-\x7b\x7d\x7e]")  # a key is printable ASCII without spaces or "|"


def _key(request_id: str) -> str:
    return f"{_UNSAFE.sub('_', request_id)[:150]}.{uuid.uuid4().hex[:12]}"


@dataclass
class _Reserved:
    key: str
    deadline: float
    landed: asyncio.Future
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    pump: asyncio.Task | None = None
    published: bool = False


class VllmLayerwiseDecodeHandover:
    """The decode side (see the module's docstring)."""

    streams_first_token = True
    overlap_reserve = True  # reserving is an engine step away: the prefill call goes out first

    def __init__(self, engine: VllmEngine, control: ControlServer, host: str, port: int) -> None:
        self.engine = engine
        self.control = control
        self.host, self.port = host, port  # where this server's ranks serve their NIXL metadata
        self._pending: dict[str, _Reserved] = {}

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      priority: int = 0, *, min_remote_tokens: int = 1, timeout_s: float = 30.0) -> Reservation:
        cached = self.engine.cached_tokens(prompt_token_ids)
        if len(prompt_token_ids) - cached < min_remote_tokens:
            return Reservation(None, cached, "short_prompt")
        if not self.control.connected():  # the server's connector is not listening (yet): compute it here
            return Reservation(None, cached, "no_free_blocks")
        key = _key(request_id)
        r = _Reserved(key, now() + timeout_s, self.control.expect("landed", key))
        reserved = self.control.expect_reserved(key)
        stream = self.engine.generate(request_id, prompt_token_ids, params, priority,
                                      kv_transfer_params=request_params("consumer", key, r.deadline))
        r.pump = asyncio.ensure_future(self._pump(stream, r.outputs))
        self._pending[request_id] = r
        done, _ = await asyncio.wait({reserved, r.pump}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if reserved not in done:  # no room on this server by the deadline, or it failed the request: local
            self.cancel(request_id)
            return Reservation(None, cached, "no_free_blocks")
        f = reserved.result()
        if not f["block_ids"]:  # vLLM found the prompt in its own cache after all: computed here
            self.cancel(request_id)
            return Reservation(None, cached, "short_prompt")
        ticket = LayerwiseTicket(key, f["engine"], f["dp"], f["tp"], self.host, self.port,
                                 self.engine.facts.block_size, f["first_block"], tuple(f["block_ids"]),
                                 f["num_tokens"], r.deadline)
        r.published = True
        return Reservation(ticket.encode(), f["first_block"] * self.engine.facts.block_size)

    @staticmethod
    async def _pump(stream: AsyncIterator[RequestOutput], outputs: asyncio.Queue) -> None:
        """Run the request's stream from its start (the HTTP request reserves the blocks), queueing its outputs."""
        try:
            async for out in stream:
                outputs.put_nowait(out)
        finally:
            outputs.put_nowait(None)

    async def landed(self, request_id: str) -> None:
        """Until the connector says the KV is in place, or that vLLM recomputes it (the request goes on either
        way); raises `HandoverFailed` when the server ended the request first or said nothing in time."""
        r = self._pending.get(request_id)
        if r is None:
            raise HandoverFailed(f"no reservation for {request_id!r}")
        limit = max(0.0, r.deadline - now()) + GRACE_S + 2.0
        done, _ = await asyncio.wait({r.landed, r.pump}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        if r.landed in done:
            ok, _, reason = r.landed.result()
            LAYERWISE.labels("landed" if ok else "recompute").inc()
            if not ok:
                log.info("KV for %s did not land (%s): its decode server recomputes the prompt", request_id, reason)
            return
        if r.pump in done and r.outputs.qsize() > 1:  # it already produced tokens: the KV was there
            return
        raise HandoverFailed("the vLLM server ended the request before its KV landed" if r.pump in done else
                             "no word from the vLLM server's connector by the ticket's deadline")

    def admit(self, request_id: str, first_token_id: int, first_logprob: Logprob | None = None,
              receipt: bytes = b"") -> AsyncIterator[RequestOutput]:
        r = self._pending.pop(request_id, None)
        if r is None:
            raise HandoverFailed(f"no reservation for {request_id!r}")
        self.control.forget(r.key)
        return self._outputs(r)

    @staticmethod
    async def _outputs(r: _Reserved) -> AsyncIterator[RequestOutput]:
        try:
            while (out := await r.outputs.get()) is not None:
                yield out
        finally:
            if r.pump is not None and not r.pump.done():  # the caller left: the request is aborted
                r.pump.cancel()

    def cancel(self, request_id: str, prefill: Awaitable[object] | None = None) -> None:
        """Abort the reserved request (vLLM holds its blocks until no write can land). A ticket never published,
        or one the prefill worker refused (nothing was written), is released at once."""
        r = self._pending.pop(request_id, None)
        if r is None:
            return
        if r.pump is not None:
            r.pump.cancel()
        self.control.forget(r.key)
        if not r.published:
            asyncio.ensure_future(self.control.to_workers("release", key=r.key))
        elif prefill is not None:
            asyncio.ensure_future(self._release_if_refused(r.key, prefill))

    async def _release_if_refused(self, key: str, prefill: Awaitable[object]) -> None:
        try:
            await prefill
        except WorkerCallError as e:
            if e.kind == "invalid":  # the prefill worker refused the ticket: it wrote nothing
                await self.control.to_workers("release", key=key)
        except (asyncio.CancelledError, Exception):  # noqa: BLE001  any other end: the deadline frees the blocks
            pass

    async def close(self) -> None:
        for request_id in list(self._pending):
            self.cancel(request_id)


class VllmLayerwisePrefillHandover:
    """The prefill side (see the module's docstring)."""

    def __init__(self, engine: VllmEngine, control: ControlServer) -> None:
        self.engine = engine
        self.control = control

    async def run(self, ticket: Awaitable[bytes], request_id: str, prompt_token_ids: Sequence[int],
                  params: SamplingParams) -> PrefillResult:
        key = _key(request_id)
        sent = self.control.expect("sent", key)
        scheduled = time.monotonic()
        completion = asyncio.ensure_future(self.engine.complete_once(
            request_id, prompt_token_ids, params, kv_transfer_params=request_params("producer", key),
            timeout_s=self.engine.spec.kv_transfer.timeout_seconds))
        delivered = False
        try:
            t = await self._ticket(ticket, prompt_token_ids)
            if not await self.control.to_workers("ticket", key=key, ticket=t.to_json()):
                raise HandoverFailed("the vLLM server's KV connector is not connected to this worker")
            delivered = True
            try:
                first, lp, cached, _ = await completion
            except (TimeoutError, httpx.HTTPError, VllmProtocolError) as e:
                raise HandoverFailed(f"vLLM prefill: {type(e).__name__}: {e}") from None
            computed = time.monotonic()
            async with asyncio.timeout(max(0.0, t.deadline - now()) + GRACE_S):
                ok, nbytes, reason = await sent
        except TimeoutError:
            LAYERWISE.labels("send_failed").inc()
            log.warning("the KV of %s: no word from the connector by its deadline (its decode server recomputes)",
                        request_id)
            ok, nbytes, computed = False, 0, time.monotonic()
        except BaseException:
            completion.cancel()
            if not delivered:  # the connector keeps the prompt's blocks for a ticket until told
                with contextlib.suppress(Exception):
                    await self.control.to_workers("drop", key=key)
            raise
        finally:
            self.control.forget(key)
        if not ok:
            LAYERWISE.labels("send_failed").inc()
            log.warning("the KV of %s was not all written (%s): its decode server recomputes the prompt",
                        request_id, reason if nbytes or reason else "no word")
        done = time.monotonic()
        return PrefillResult(first, lp, cached, nbytes, scheduled, computed, done)

    async def _ticket(self, ticket: Awaitable[bytes], prompt: Sequence[int]) -> LayerwiseTicket:
        """The ticket, checked against this request and this server (`BadTicket` names what does not fit)."""
        raw = await ticket
        try:
            t = LayerwiseTicket.decode(raw)
        except WireError as e:
            raise BadTicket(str(e)) from None
        if t.block_size != self.engine.facts.block_size:
            raise BadTicket(f"the ticket's blocks hold {t.block_size} tokens, this server's "
                            f"{self.engine.facts.block_size} (model.blockSize must match)")
        if t.num_tokens != len(prompt):
            raise BadTicket(f"the ticket is for {t.num_tokens} prompt tokens, the request has {len(prompt)}")
        if t.tp_size != self.engine.facts.tensor_parallel_size:
            raise BadTicket(f"prefill TP={self.engine.facts.tensor_parallel_size} into decode TP={t.tp_size}: the "
                            "layerwise connector moves equal shards only")
        if t.deadline <= now():
            raise BadTicket("the ticket's deadline has passed")
        return t

    async def close(self) -> None:
        pass
