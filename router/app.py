"""The OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

Per request: parse and tokenize (off the event loop), let the gateway route and generate, and answer as JSON or
SSE. This module imports no engine and no torch: a gateway runs from a slim image and starts in a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.common.config import ClusterSpec
from splitserve.common.membership import Membership
from splitserve.router import metrics as m
from splitserve.router.errors import APIError, bad
from splitserve.router.gateway import Gateway, Piece
from splitserve.router.openai_protocol import GenerationSpec, parse

log = logging.getLogger("splitserve.router")
MAX_BODY = 16 << 20
SESSION_HEADER = "x-session-id"


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


class HTTPApi:
    def __init__(self, spec: ClusterSpec, membership: Membership) -> None:
        self.spec = spec
        self.gw = Gateway(spec, membership)
        self.inflight = 0
        self.created = int(time.time())

    # -- HTTP handlers --------------------------------------------------------------------------------
    async def _body(self, request: Request):
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise APIError(413, "request body too large")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"request body is not valid JSON: {e}") from None

    async def completions(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            body = await self._body(request)
            gw = self.gw
            spec = await asyncio.to_thread(parse, body, chat, gw.tokenizer, gw.max_model_len, {gw.model_name})
            if spec.session_key is None:
                spec.session_key = request.headers.get(SESSION_HEADER)
            if self.inflight >= self.spec.router.max_inflight:
                raise APIError(429, "too many requests in flight; retry later", code="queue_full")
            if not gw.can_serve():
                raise APIError(503, "no healthy decode worker is available", code="no_workers")
        except APIError as e:
            m.REQUESTS.labels(endpoint, str(e.status)).inc()
            return e.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        m.PROMPT_TOKENS.inc(len(spec.prompt_token_ids))
        if spec.stream:
            return StreamingResponse(self._sse(spec, rid, endpoint), media_type="text/event-stream")
        return await self._unary(spec, rid, endpoint)

    def _admit(self) -> float:
        self.inflight += 1
        m.QUEUE_DEPTH.set(self.inflight)
        return time.monotonic()

    def _release(self) -> None:
        self.inflight -= 1
        m.QUEUE_DEPTH.set(self.inflight)

    async def _unary(self, spec: GenerationSpec, rid: str, endpoint: str) -> Response:
        t0 = self._admit()
        text, lps, finish, usage = [], [], None, (len(spec.prompt_token_ids), 0)
        clock = _TokenClock(t0)
        try:
            async for p in self.gw.generate(spec, rid):
                clock.tick(p)
                text.append(p.text)
                lps.extend(p.logprobs)
                finish = p.finish_reason
                usage = (p.prompt_tokens, p.completion_tokens)
        except APIError as e:
            m.REQUESTS.labels(endpoint, str(e.status)).inc()
            return e.response()
        finally:
            self._release()
        m.E2E.observe(time.monotonic() - t0)
        m.GENERATION_TOKENS.inc(usage[1])
        m.REQUESTS.labels(endpoint, "200").inc()
        body = {"id": rid, "created": int(time.time()), "model": self.gw.model_name,
                "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}}
        if spec.chat:
            body["object"] = "chat.completion"
            body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                                "logprobs": self._chat_logprobs(lps, spec) if spec.logprobs else None,
                                "finish_reason": finish}]
        else:
            body["object"] = "text_completion"
            body["choices"] = [{"index": 0, "text": "".join(text), "finish_reason": finish,
                                "logprobs": self._completion_logprobs(lps) if spec.logprobs else None}]
        return JSONResponse(body)

    async def _sse(self, spec: GenerationSpec, rid: str, endpoint: str) -> AsyncIterator[str]:
        t0 = self._admit()
        created = int(time.time())
        obj = "chat.completion.chunk" if spec.chat else "text_completion"
        usage = (len(spec.prompt_token_ids), 0)
        status = "200"
        clock = _TokenClock(t0)

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
            async for p in self.gw.generate(spec, rid):
                clock.tick(p)
                usage = (p.prompt_tokens, p.completion_tokens)
                if not p.text and p.finish_reason is None:
                    continue
                if spec.chat:
                    lp = self._chat_logprobs(p.logprobs, spec) if spec.logprobs else None
                    yield chunk({"index": 0, "delta": {"content": p.text} if p.text else {}, "logprobs": lp,
                                 "finish_reason": p.finish_reason})
                else:
                    lp = self._completion_logprobs(p.logprobs) if spec.logprobs else None
                    yield chunk({"index": 0, "text": p.text, "logprobs": lp, "finish_reason": p.finish_reason})
            if spec.include_usage:
                yield chunk(None, {"usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                             "total_tokens": sum(usage)}})
            m.E2E.observe(time.monotonic() - t0)
        except APIError as e:
            status = str(e.status)
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            self._release()
            m.GENERATION_TOKENS.inc(usage[1])
            m.REQUESTS.labels(endpoint, status).inc()
        yield "data: [DONE]\n\n"

    def _token_text(self, tid: int) -> str:
        return self.gw.tokenizer.decode([tid])

    def _chat_logprobs(self, lps, spec: GenerationSpec) -> dict:
        content = []
        for lp in lps:
            tok = self._token_text(lp.token_id)
            content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": self._token_text(t.token_id), "logprob": t.logprob,
                                              "bytes": list(self._token_text(t.token_id).encode())}
                                             for t in lp.top[: spec.top_logprobs]]})
        return {"content": content}

    def _completion_logprobs(self, lps) -> dict:
        return {"tokens": [self._token_text(lp.token_id) for lp in lps],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token_text(t.token_id): t.logprob for t in lp.top} for lp in lps],
                "text_offset": []}

    async def models(self, _: Request) -> Response:
        gw = self.gw
        return JSONResponse({"object": "list", "data": [{"id": gw.model_name, "object": "model",
                                                          "created": self.created, "owned_by": "splitserve",
                                                          "max_model_len": gw.max_model_len}]})

    async def health(self, _: Request) -> Response:
        workers = [{"name": w.info.name, "endpoint": w.endpoint, "role": w.info.role, "healthy": w.load.healthy,
                    "draining": w.load.draining, "outstanding": w.load.outstanding} for w in self.gw.workers.workers]
        ok = self.gw.can_serve()
        body = {"status": "ok" if ok else "unavailable", "all_healthy": all(w["healthy"] for w in workers),
                "workers": workers}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def build_app(spec: ClusterSpec, membership: Membership) -> Starlette:
    gw = HTTPApi(spec, membership)

    async def chat(request: Request) -> Response:
        return await gw.completions(request, chat=True)

    async def completions(request: Request) -> Response:
        return await gw.completions(request, chat=False)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        await gw.gw.workers.start()
        yield
        await gw.gw.workers.close()

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
            Route("/v1/models", gw.models, methods=["GET"]),
            Route("/health", gw.health, methods=["GET"]),
            Route("/metrics", gw.metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={Exception: server_error, 404: not_found, 405: method_not_allowed},
    )
    app.state.gateway = gw
    return app


async def serve(spec: ClusterSpec, membership: Membership, host: str) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(spec, membership), host=host, port=spec.router.port,
                                           log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    await server.serve()

