"""The OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics,
/openapi.json, and POST /admin/flip (a worker's role flip, `router.flips`).

Per request: check the body (type and size, before reading it all), parse and tokenize it off the event loop,
wait for a seat (bounded admission), let the gateway route and generate, and answer as JSON or SSE. Nothing here
blocks the event loop, so /health answers at once whatever the requests are doing. This module imports no
engine and no torch: a gateway runs from a slim image and starts in a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from splitserve import __version__
from splitserve.common.config import ClusterSpec
from splitserve.common.membership import Membership, StaticMembership
from splitserve.common.redis_link import RedisLink
from splitserve.router import flips, openapi
from splitserve.router import metrics as m
from splitserve.router.admission import Admission
from splitserve.router.cluster import ClusterState
from splitserve.router.errors import APIError, bad
from splitserve.router.gateway import Gateway, Piece
from splitserve.router.openai_protocol import GenerationSpec, parse

log = logging.getLogger("splitserve.router")
SESSION_HEADER = "x-session-id"
API_KEYS_ENV = "SPLITSERVE_API_KEYS"
PARSE_INLINE_BYTES = 64 << 10  # bodies up to this size are parsed on the loop (cheaper than a thread hop)


async def _client_left(request: Request) -> None:
    """Returns once the client has hung up (its body already read, the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _TokenClock:
    """Observes time to first token and inter-token latency as pieces with tokens arrive."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.last: float | None = None

    def tick(self, piece: Piece) -> None:
        if not piece.token_ids:
            return
        now = time.monotonic()
        if self.last is None:
            m.TTFT.observe(now - self.t0)
        else:
            m.ITL.observe(now - self.last)
        self.last = now


class _SeatedResponse(StreamingResponse):
    """A stream that gives its admission seat back however it ends (finished, failed, or never started
    because the client left first)."""

    def __init__(self, content: AsyncIterator[str], admission: Admission) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release()


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def cluster_for(spec: ClusterSpec) -> tuple[Membership, ClusterState | None]:
    """Membership (and, with Redis, the shared cluster state: registry, KV index, peers' load) per the config."""
    url = spec.redis.resolved_url()
    if url:
        cluster = ClusterState(RedisLink(url), spec.model.served_name, snapshot_s=spec.redis.snapshot_seconds,
                               lease_s=spec.redis.lease_seconds)
        return cluster.membership, cluster
    return StaticMembership(spec.membership.prefill, spec.membership.decode, spec.worker_role("decode")), None


class HTTPApi:
    def __init__(self, spec: ClusterSpec, membership: Membership, cluster: ClusterState | None = None) -> None:
        self.spec = spec
        self.gw = Gateway(spec, membership, cluster)
        rs = spec.router
        self.admission = Admission(rs.max_inflight, rs.max_queue, rs.queue_timeout_seconds)
        self.created = int(time.time())
        keys = os.environ.get(API_KEYS_ENV, "")
        self.api_keys = [k.strip() for k in keys.split(",") if k.strip()]

    # -- the request body -------------------------------------------------------------------------------
    async def _body(self, request: Request):
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise APIError(415, f"Content-Type must be application/json, not {ctype!r}", code="unsupported_media_type")
        limit = self.spec.router.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body is over the limit of {limit} bytes", code="body_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(400, "the client went away while sending the body") from None
        raw = b"".join(chunks)
        try:
            return json.loads(raw) if size <= PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"request body is not valid JSON: {e}") from None
        except RecursionError:  # the decoder's own limit on nesting
            raise bad("request body nests too deep") from None

    def _check_key(self, request: Request) -> None:
        if not self.api_keys:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not any(hmac.compare_digest(given, k) for k in self.api_keys):
            raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)", type_="authentication_error",
                           code="invalid_api_key")

    # -- completions --------------------------------------------------------------------------------------
    async def completions(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            self._check_key(request)
            body = await self._body(request)
            gw = self.gw
            spec = await asyncio.to_thread(parse, body, chat, gw.tokenizer, gw.max_model_len, {gw.model_name},
                                           gw.max_prompt_chars)
            if spec.session_key is None:
                spec.session_key = request.headers.get(SESSION_HEADER)
            gw.check_servable()
            await self.admission.acquire()
        except APIError as e:
            m.REQUESTS.labels(endpoint, str(e.status)).inc()
            return e.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        m.PROMPT_TOKENS.inc(len(spec.prompt_token_ids))
        if spec.stream:
            return _SeatedResponse(self._sse(spec, rid, endpoint), self.admission)
        try:
            return await self._unary(spec, rid, endpoint, request)
        finally:
            self.admission.release()

    async def _unary(self, spec: GenerationSpec, rid: str, endpoint: str, request: Request) -> Response:
        t0 = time.monotonic()
        text: list[str] = []
        lps: list = []
        clock = _TokenClock(t0)

        async def collect() -> tuple[str | None, tuple[int, int, int]]:
            finish, usage = None, (len(spec.prompt_token_ids), 0, 0)
            async for p in self.gw.generate(spec, rid):
                clock.tick(p)
                text.append(p.text)
                lps.extend(p.logprobs)
                finish = p.finish_reason
                usage = (p.prompt_tokens, p.completion_tokens, p.cached_tokens)
                if finish == "error":  # it failed after its first token and could not move
                    raise APIError(500, p.error, code="worker_error")
            return finish, usage

        # a client that leaves stops its tokens: the generation is cancelled (the worker aborts the request), as a
        # stream's is, instead of running to max_tokens for nobody
        work = asyncio.ensure_future(collect())
        left = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait((work, left), return_when=asyncio.FIRST_COMPLETED)
            gone = left.done()
        finally:
            left.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)  # its cancellation closes the worker's stream
        if work.cancelled():
            m.REQUESTS.labels(endpoint, m.CLIENT_CLOSED).inc()
            return Response(status_code=499)
        try:
            finish, usage = work.result()
        except APIError as e:
            m.REQUESTS.labels(endpoint, str(e.status)).inc()
            return e.response()
        m.E2E.observe(time.monotonic() - t0)
        m.GENERATION_TOKENS.inc(usage[1])
        m.REQUESTS.labels(endpoint, m.CLIENT_CLOSED if gone else "200").inc()
        body = {"id": rid, "created": int(time.time()), "model": self.gw.model_name, "usage": _usage(*usage)}
        if spec.chat:
            body["object"] = "chat.completion"
            body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                                "logprobs": self._chat_logprobs(lps, spec) if spec.logprobs else None,
                                "finish_reason": finish}]
        else:
            body["object"] = "text_completion"
            body["choices"] = [{"index": 0, "text": "".join(text), "finish_reason": finish,
                                "logprobs": self._completion_logprobs(lps, 0)[0] if spec.logprobs else None}]
        return JSONResponse(body)

    async def _sse(self, spec: GenerationSpec, rid: str, endpoint: str) -> AsyncIterator[str]:
        t0 = time.monotonic()
        created = int(time.time())
        obj = "chat.completion.chunk" if spec.chat else "text_completion"
        usage = (len(spec.prompt_token_ids), 0, 0)
        status = m.CLIENT_CLOSED  # until the stream ends: a client that leaves first cancels or closes it
        clock = _TokenClock(t0)
        offset = 0  # characters of completion text before this chunk's tokens (text_offset)

        def chunk(choice: dict | None, extra: dict | None = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.gw.model_name,
                    "choices": [choice] if choice is not None else []}
            if extra:
                body.update(extra)
            return f"data: {json.dumps(body)}\n\n"

        try:
            if spec.chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            finish = None
            async for p in self.gw.generate(spec, rid):
                clock.tick(p)
                usage = (p.prompt_tokens, p.completion_tokens, p.cached_tokens)
                finish = p.finish_reason
                if not p.text and p.finish_reason is None and not p.logprobs:
                    continue
                if spec.chat:
                    lp = self._chat_logprobs(p.logprobs, spec) if spec.logprobs else None
                    yield chunk({"index": 0, "delta": {"content": p.text} if p.text else {}, "logprobs": lp,
                                 "finish_reason": p.finish_reason})
                else:
                    lp = None
                    if spec.logprobs:
                        lp, offset = self._completion_logprobs(p.logprobs, offset)
                    yield chunk({"index": 0, "text": p.text, "logprobs": lp, "finish_reason": p.finish_reason})
            if spec.include_usage:
                yield chunk(None, {"usage": _usage(*usage)})
            if finish == "error":  # it failed after its first token and could not move
                status = "500"
            else:
                status = "200"
                m.E2E.observe(time.monotonic() - t0)
        except APIError as e:
            status = str(e.status)
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception:  # a bug: counted as what it is, then raised
            status = "500"
            raise
        finally:
            m.GENERATION_TOKENS.inc(usage[1])
            m.REQUESTS.labels(endpoint, status).inc()
        yield "data: [DONE]\n\n"

    # -- log-probabilities --------------------------------------------------------------------------------
    def _token(self, tid: int) -> tuple[str, list[int]]:
        """A token's text and its own bytes (part of a UTF-8 character for some tokens)."""
        tok = self.gw.tokenizer
        return tok.decode([tid]), list(tok.token_bytes(tid))

    def _chat_logprobs(self, lps, spec: GenerationSpec) -> dict:
        content = []
        for lp in lps:
            text, raw = self._token(lp.token_id)
            top = []
            for tid, value in lp.top[: spec.top_logprobs]:  # (token id, logprob), best first
                t_text, t_raw = self._token(tid)
                top.append({"token": t_text, "logprob": value, "bytes": t_raw})
            content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, lps, offset: int) -> tuple[dict, int]:
        """The legacy completions shape; `offset` is the completion text's length before these tokens."""
        tokens, offsets = [], []
        for lp in lps:
            text = self._token(lp.token_id)[0]
            offsets.append(offset)
            tokens.append(text)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(tid)[0]: value for tid, value in lp.top} for lp in lps],
                "text_offset": offsets}, offset

    # -- the rest -----------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except APIError as e:
            return e.response()
        gw = self.gw
        return JSONResponse({"object": "list", "data": [{"id": gw.model_name, "object": "model",
                                                          "created": self.created, "owned_by": "splitserve",
                                                          "max_model_len": gw.max_model_len}]})

    async def health(self, _: Request) -> Response:
        cluster = self.gw.cluster
        indexed = cluster.index.blocks_per_worker() if cluster is not None else {}
        workers = [{"name": w.info.name, "instance_id": w.info.instance_id, "endpoint": w.endpoint,
                    "role": w.info.role, "engine": w.engine or None, "capabilities": sorted(w.capabilities),
                    "kv_connector": w.kv_connector or None, "kv_transports": w.kv_transports,
                    "state": w.state, "healthy": w.load.healthy, "draining": w.load.draining,
                    "outstanding": w.load.outstanding, "peer_outstanding": w.load.peer_outstanding,
                    "indexed_blocks": indexed.get((w.info.name, w.info.instance_id), 0)}
                   for w in self.gw.workers.workers]
        ok = self.gw.can_serve()
        body = {"status": "ok" if ok else "unavailable", "all_healthy": bool(workers) and all(
                    w["healthy"] for w in workers), "inflight": self.admission.inflight,
                "queued": self.admission.queued, "policy": self.gw.policy.name, "workers": workers}
        if cluster is not None:
            body["index"] = {"usable": cluster.usable, "redis_up": cluster.link.up, "blocks": cluster.index.num_blocks,
                             "stale_instances": sorted(f"{w}/{i}" for w, i in indexed if
                                                       cluster.instances().get(w) != i)}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def flip(self, request: Request) -> Response:
        """A worker's role flip (API keys, when set, are asked for as on every call)."""
        try:
            self._check_key(request)
            answer = await flips.flip(self.gw, flips.parse_flip(await self._body(request)))
        except APIError as e:
            return e.response()
        return JSONResponse(answer)

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, _: Request) -> Response:
        gw = self.gw
        return JSONResponse(openapi.document([gw.model_name], gw.tokenizer.vocab_size, self.spec.router.max_body_bytes,
                                             __version__))


def build_app(spec: ClusterSpec, membership: Membership | None = None,
              cluster: ClusterState | None = None) -> Starlette:
    if membership is None:
        membership, cluster = cluster_for(spec)
    api = HTTPApi(spec, membership, cluster)

    async def chat(request: Request) -> Response:
        return await api.completions(request, chat=True)

    async def completions(request: Request) -> Response:
        return await api.completions(request, chat=False)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        await api.gw.start()
        yield
        await api.gw.close()

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, "internal server error").response()

    async def not_found(request: Request, exc: Exception) -> Response:
        return APIError(404, f"no route {request.url.path}", code="not_found").response()

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return APIError(405, f"method {request.method} not allowed on {request.url.path}").response()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
            Route("/openapi.json", api.openapi, methods=["GET"]),
            Route("/admin/flip", api.flip, methods=["POST"]),
        ],
        lifespan=lifespan,
        exception_handlers={Exception: server_error, 404: not_found, 405: method_not_allowed},
    )
    app.state.api = api
    return app


async def serve(spec: ClusterSpec, host: str) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(spec), host=host, port=spec.router.port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=spec.decode.drain_seconds))
    await server.serve()
