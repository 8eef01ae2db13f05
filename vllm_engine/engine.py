"""vLLM as a `ServingEngine`: a stock vLLM OpenAI server (this worker's child locally, the container beside it in a
pod) driven over its HTTP API with token ids in and token ids out (`wire`), its load read off its /metrics, its KV
events read off its ZMQ publisher and bridged to our chained block hashes (`kv_events`).

Nothing of vLLM is imported: the worker runs beside the server, never inside it. Everything the server sends is
validated before use (a chunk that does not parse ends its request with an error). The server is watched: if it
exits, refuses connections for `REFUSED_DEAD_S` or answers nothing for `SILENT_DEAD_S`, the engine is dead, its
streams end with an error, and the worker reports itself not live.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from splitserve.common.config import ClusterSpec
from splitserve.common.hashing import hash_token_blocks
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.worker_messages import RetryReason
from splitserve.engine.interface import KVEventListener, ModelFacts
from splitserve.engine.outputs import RequestOutput
from splitserve.vllm_engine.control import ControlServer
from splitserve.vllm_engine.kv_events import VllmEventError, VllmKVEventBridge
from splitserve.vllm_engine.server import EVENTS_TOPIC, VllmServer, is_cpu
from splitserve.vllm_engine.wire import (
    FINISH,
    MAX_CHUNK,
    ServerLoad,
    VllmProtocolError,
    error_message,
    parse_choice,
    parse_load,
    parse_logprobs,
    parse_usage,
    request_body,
)

log = logging.getLogger("splitserve.vllm")

POLL_S = 0.5  # /metrics (load, liveness)
REFUSED_DEAD_S = 10.0  # a server refusing connections this long is gone
SILENT_DEAD_S = 120.0  # a server answering nothing at all this long is stuck


def model_facts(spec: ClusterSpec, model_dir: Path, max_model_len: int, num_kv_blocks: int) -> ModelFacts:
    """The model as the roles see it, from its config files and what the server reported."""
    config = json.loads((model_dir / "config.json").read_text())
    generation = model_dir / "generation_config.json"
    eos: set[int] = set()
    for doc in (config, json.loads(generation.read_text()) if generation.is_file() else {}):
        value = doc.get("eos_token_id")
        eos.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"{model_dir}/config.json has no vocab_size")
    device = "cpu" if is_cpu(spec) else (spec.model.device if spec.model.device.startswith("cuda") else "cuda")
    return ModelFacts(spec.model.served_name, vocab, max_model_len, frozenset(eos), spec.model.tensor_parallel_size,
                      device, spec.model.block_size, num_kv_blocks)


def events_socket(endpoint: str) -> Any:
    """The SUB socket vLLM's KV event publisher sends to. vLLM connects its PUB socket to an endpoint with a
    host (it binds only wildcards), so the worker binds this one on loopback and the server connects to it:
    nothing listens beyond loopback. Bound before the server starts, so no event is published into the void."""
    import zmq
    import zmq.asyncio

    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, EVENTS_TOPIC.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


class VllmEngine:
    """The engine a vLLM worker's roles use (see the module's docstring)."""

    def __init__(self, spec: ClusterSpec, base_url: str, events_endpoint: str, facts: ModelFacts,
                 server: VllmServer | None = None, events: Any = None, pool_worker: str | None = None,
                 control: ControlServer | None = None, side_channel: tuple[str, int] = ("", 0)) -> None:
        self.spec = spec
        self.base_url = base_url
        self.events_endpoint = events_endpoint
        self.facts = facts
        self.server = server
        self.model = spec.model.served_name
        self._dead_reason = ""
        self._listeners: list[KVEventListener] = []
        self._held: set[int] = set()  # our hashes of the blocks vLLM holds (as its events told)
        self.bridge = VllmKVEventBridge(self.model, facts.block_size, EVENTS_TOPIC)
        self._load = ServerLoad(num_kv_blocks=facts.num_kv_blocks)
        self._last_answer = time.monotonic()
        self._prefill_pending: dict[str, int] = {}  # request id -> prompt tokens, until its first output
        self._responses: dict[str, httpx.Response] = {}  # streams in flight, to abort
        self._aborted: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._client: httpx.AsyncClient | None = None
        self._zmq: Any = events  # the bound SUB socket (`events_socket`), or None: bound at start
        self.pool_worker = pool_worker  # the name its server's KV pool connector writes events and stats under
        self.control = control  # the line to its server's layerwise connector (vllm.connector layerwise)
        self.side_channel = side_channel  # (host, port) where its server's ranks serve their NIXL metadata

    # -- lifetime ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the HTTP client, subscribe to the KV events, start watching the server (on the role's loop)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(base_url=self.base_url, limits=limits,
                                         timeout=httpx.Timeout(10.0, read=None))
        self._tasks = [asyncio.ensure_future(self._watch()), asyncio.ensure_future(self._events())]
        if self.control is not None:
            self.control.start()
        url = self.spec.redis.resolved_url()
        if self.pool_worker is not None and url:  # the pool connector's counters, on this worker's /metrics
            from splitserve.common.redis_link import RedisLink
            from splitserve.vllm_engine.pool_stats import PoolStatsMirror

            mirror = PoolStatsMirror(RedisLink(url), self.model, self.pool_worker)
            self._tasks.append(asyncio.ensure_future(mirror.run()))

    @property
    def dead(self) -> bool:
        return bool(self._dead_reason)

    def _die(self, reason: str) -> None:
        if self._dead_reason:
            return
        self._dead_reason = reason
        log.error("vLLM engine dead: %s", reason)
        for resp in list(self._responses.values()):
            asyncio.ensure_future(resp.aclose())

    async def _watch(self) -> None:
        """Load off /metrics every POLL_S; death: the child exited, or the server refused connections (gone)
        for REFUSED_DEAD_S, or answered nothing at all for SILENT_DEAD_S (a busy server answers slowly, and a
        slow answer is not death)."""
        assert self._client is not None
        refused_since: float | None = None
        while True:
            code = self.server.exited if self.server is not None else None
            if code is not None:
                self._die(f"the vLLM server exited with code {code}")
                return
            now = time.monotonic()
            try:
                resp = await self._client.get("/metrics", timeout=10.0)
                refused_since = None
                self._last_answer = time.monotonic()
                if resp.status_code == 200:
                    self._load = parse_load(resp.text)
            except httpx.ConnectError as e:
                refused_since = refused_since or now
                log.debug("vLLM /metrics: %s", e)
            except (httpx.HTTPError, ValueError) as e:  # slow, or a page that does not parse
                log.debug("vLLM /metrics: %s", e)
            if refused_since is not None and now - refused_since > REFUSED_DEAD_S:
                self._die(f"the vLLM server has refused connections for {REFUSED_DEAD_S:.0f} s")
                return
            if now - self._last_answer > SILENT_DEAD_S:
                self._die(f"the vLLM server has not answered for {SILENT_DEAD_S:.0f} s")
                return
            await asyncio.sleep(POLL_S)

    async def _events(self) -> None:
        sock = self._zmq if self._zmq is not None else events_socket(self.events_endpoint)
        self._zmq = sock
        warned = False
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    events = self.bridge.feed(frames)
                except VllmEventError as e:
                    if not warned:
                        log.warning("a KV event batch from vLLM did not validate (dropped, the index resyncs): %s", e)
                        warned = True
                    self.bridge.reset()
                    events = [AllBlocksCleared()]
                for event in events:
                    self._emit(event)
        finally:
            sock.close(linger=0)

    def _emit(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            self._held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._held.difference_update(event.block_hashes)
        else:
            self._held.clear()
        for listener in self._listeners:
            listener(event)

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        self._listeners.append(listener)

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """Prompt tokens in blocks vLLM holds (its events say so), as a prefix; at most all but the last."""
        n = 0
        for h in hash_token_blocks(prompt, self.facts.block_size, self.model):
            if h not in self._held:
                break
            n += self.facts.block_size
        return min(n, max(0, len(prompt) - 1))

    def stats(self) -> dict[str, int]:
        load = self._load
        total = load.num_kv_blocks or self.facts.num_kv_blocks
        waiting_tokens = sum(self._prefill_pending.values())
        return {"num_waiting": load.num_waiting, "num_running": load.num_running,
                "kv_blocks_used": int(round(load.kv_usage * total)), "kv_blocks_total": total,
                "tokens_in_flight": waiting_tokens, "waiting_prefill_tokens": waiting_tokens,
                "num_waiting_remote_kv": 0, "num_held": 0}

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.server is not None:
            self.server.stop()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.control is not None:
            await self.control.close()
        if self._client is not None:
            await self._client.aclose()

    # -- requests ------------------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        resp = self._responses.get(request_id)
        if resp is not None:
            self._aborted.add(request_id)
            await resp.aclose()  # vLLM aborts a request whose client hung up

    async def complete_once(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                            kv_transfer_params: dict[str, Any] | None = None,
                            timeout_s: float = 30.0) -> tuple[int, Logprob | None, int, dict | None]:
        """One non-streamed completion (a prefill: max_tokens 1): (first token, its logprob, cached prompt
        tokens, the kv_transfer_params it returned). Raises `VllmProtocolError` or `httpx.HTTPError`."""
        if self._client is None or self.dead:
            raise VllmProtocolError(f"the vLLM server is not serving ({self._dead_reason or 'not started'})")
        body = request_body(self.model, request_id, prompt, params, 0, stream=False)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        self._prefill_pending[request_id] = len(prompt)
        try:
            resp = await self._client.post("/v1/completions", json=body, timeout=timeout_s)
        finally:
            self._prefill_pending.pop(request_id, None)
        if len(resp.content) > MAX_CHUNK:
            raise VllmProtocolError("a completion larger than 1 MiB")
        try:
            data = resp.json()
        except ValueError:
            raise VllmProtocolError(f"HTTP {resp.status_code}, not JSON") from None
        if resp.status_code != 200:
            raise VllmProtocolError(f"HTTP {resp.status_code}: {error_message(data)}")
        ids, lp, _, _ = parse_choice(data, self.facts.vocab_size)
        if len(ids) != 1:
            raise VllmProtocolError(f"a prefill returned {len(ids)} tokens, not 1")
        logprobs = parse_logprobs(lp, 1, params.logprobs)
        usage = parse_usage(data)
        params_out = data.get("kv_transfer_params")
        if params_out is not None and not isinstance(params_out, dict):
            raise VllmProtocolError("kv_transfer_params: not an object")
        return ids[0], logprobs[0] if logprobs else None, usage[1] if usage else 0, params_out

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 priority: int = 0, kv_transfer_params: dict[str, Any] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (`kv_transfer_params`: pull the prompt's KV from a prefill worker first)."""
        return self._stream(request_id, list(prompt_token_ids), params, priority, kv_transfer_params)

    async def _stream(self, rid: str, prompt: list[int], params: SamplingParams, priority: int,
                      kv_transfer_params: dict[str, Any] | None) -> AsyncIterator[RequestOutput]:
        n_out = 0

        def failed(message: str) -> RequestOutput:
            return RequestOutput(rid, [], finished=True, finish_reason="error", num_prompt_tokens=len(prompt),
                                 num_output_tokens=n_out, error=message)

        if self._client is None or self.dead:
            yield failed(f"the vLLM server is not serving ({self._dead_reason or 'not started'})")
            return
        try:
            body = request_body(self.model, rid, prompt, params, priority, stream=True)
        except ValueError as e:
            yield failed(str(e))
            return
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        self._prefill_pending[rid] = len(prompt)
        final: RequestOutput | None = None
        cached = 0
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as resp:
                self._responses[rid] = resp
                if resp.status_code != 200:
                    text = (await resp.aread())[:MAX_CHUNK]
                    try:
                        message = error_message(json.loads(text))
                    except ValueError:
                        message = text.decode(errors="replace")[:500]
                    yield failed(f"vLLM: HTTP {resp.status_code}: {message}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data.strip() == "[DONE]":
                        break
                    if len(data) > MAX_CHUNK:
                        raise VllmProtocolError("a streamed chunk larger than 1 MiB")
                    chunk = json.loads(data)
                    ids, lp, finish, stop_reason = parse_choice(chunk, self.facts.vocab_size)
                    usage = parse_usage(chunk)  # in every chunk (continuous_usage_stats)
                    if usage is not None:
                        cached = usage[1]
                        if final is not None:
                            final.num_prompt_tokens, final.num_cached_tokens, final.num_output_tokens = usage
                    if not ids and finish is None:
                        continue
                    self._prefill_pending.pop(rid, None)
                    n_out += len(ids)
                    out = RequestOutput(rid, ids, parse_logprobs(lp, len(ids), params.logprobs),
                                        num_prompt_tokens=len(prompt), num_cached_tokens=cached,
                                        num_output_tokens=n_out)
                    if finish is not None:
                        out.finished = True
                        out.finish_reason = FINISH.get(finish, "stop" if finish == "repetition" else "error")
                        out.stop_reason = stop_reason if isinstance(stop_reason, int | str) else None
                        if out.finish_reason == "error":
                            out.error = f"vLLM finished it with {finish!r}"
                        final = out  # sent once the usage (or the end) is read
                        continue
                    if final is not None:
                        raise VllmProtocolError("tokens after the finish")
                    yield out
            if final is None:
                yield failed(self._dead_reason or "the vLLM stream ended without a finish")
            else:
                yield final
        except (httpx.HTTPError, httpx.StreamError, VllmProtocolError, ValueError) as e:
            # StreamError: the response was closed under the read (`abort`, or the engine died)
            if final is not None:
                yield final
            elif rid in self._aborted:
                yield RequestOutput(rid, [], finished=True, finish_reason="abort", num_prompt_tokens=len(prompt),
                                    num_output_tokens=n_out)
            else:
                code = self.server.exited if self.server is not None else None
                if code is not None:  # noticed here first: the stream broke because the server is gone
                    self._die(f"the vLLM server exited with code {code}")
                out = failed(self._dead_reason or f"vLLM: {type(e).__name__}: {e}")
                # the connection to the server broke, not the request: another worker may continue it
                if isinstance(e, httpx.TransportError | httpx.StreamError):
                    out.retry = RetryReason.ENGINE
                yield out
        finally:
            self._prefill_pending.pop(rid, None)
            self._responses.pop(rid, None)
            self._aborted.discard(rid)


__all__ = ["VllmEngine", "events_socket", "model_facts", "parse_load"]
