"""The gateway's moves, against scripted workers on real gRPC over loopback: what a moved request carries
(resume tokens, reduced max_tokens/min_tokens, output_offset past them), who gets it (never a worker whose
health lacks `resume`), when it moves (a dead connection, a stall, a retryable error) and when it does not (bad
input, an error the worker did not mark retryable, past migrationLimit), and what the client sees either way.

Each scripted worker continues one fixed token script from where the request stands (`len(resume_token_ids)`),
so the client's text is the same however often the request moves."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from splitserve.common.config import ClusterSpec
from splitserve.common.membership import StaticMembership
from splitserve.common.proc import free_port
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.router import metrics as m
from splitserve.router.errors import APIError
from splitserve.router.gateway import Gateway
from splitserve.router.openai_protocol import parse

TEXT = " The quick brown fox jumps over the lazy dog while the cat sleeps"


@dataclass
class Script:
    """How one worker behaves: after `fail_after` tokens of a call, `how` (none: it finishes)."""

    fail_after: int = 1 << 30
    how: str = "none"  # none | die | stall | pause | retry | fatal | invalid
    pause: float = 0.0  # how: pause waits this long, then goes on
    resume: bool = True  # its health lists the capability
    busy: int = 0  # its first `busy` calls answer busy before any token (no KV room for the prompt)
    calls: list[pb.GenerateRequest] = field(default_factory=list)


class ScriptedWorker(pb_grpc.WorkerServicer):
    def __init__(self, script: Script, tokens: list[int]) -> None:
        self.script, self.tokens = script, tokens

    async def Generate(self, request, context):
        s = self.script
        s.calls.append(request)
        if s.busy:
            s.busy -= 1
            yield pb.GenerateResponse(request_id=request.request_id, finished=True, finish_reason="error",
                                      error="no KV room for the prompt within 1 s", retry="busy")
            return
        start = len(request.resume_token_ids)
        sent = 0
        for tid in self.tokens[start:start + request.params.max_tokens]:
            if sent == s.fail_after:
                if s.how == "die":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
                if s.how == "invalid":
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: out of range")
                if s.how == "stall":
                    await asyncio.sleep(3600)
                if s.how == "pause":
                    await asyncio.sleep(s.pause)
                if s.how in ("retry", "fatal"):
                    yield pb.GenerateResponse(request_id=request.request_id, finished=True, finish_reason="error",
                                              error="engine step failed", retry="engine" if s.how == "retry" else "")
                    return
            sent += 1
            done = sent == request.params.max_tokens
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[tid], finished=done,
                                      finish_reason="length" if done else "", prompt_tokens=len(request.prompt_token_ids),
                                      completion_tokens=start + sent)

    async def Health(self, request, context):
        return pb.HealthResponse(live=True, ready=True, role="decode", model="smollm2", protocol_version=PROTOCOL_VERSION,
                                 capabilities=["resume"] if self.script.resume else [])


async def serve(scripts: list[Script], body: dict, **router) -> tuple[str, str | None, tuple, Gateway]:
    """Run `body` through a gateway over one worker per script; (text, finish_reason, usage, gateway)."""
    spec = ClusterSpec.model_validate({"mode": "colocated", "router": {"healthIntervalSeconds": 0.2, **router}})
    servers, endpoints = [], []
    gw = None
    try:
        for _ in scripts:
            server = grpc.aio.server()
            port = free_port()
            server.add_insecure_port(f"127.0.0.1:{port}")
            servers.append(server)
            endpoints.append(f"127.0.0.1:{port}")
        gw = Gateway(spec, StaticMembership([], endpoints, "both"))
        tokens = gw.tokenizer.encode(TEXT)
        for s, server in zip(scripts, servers, strict=True):
            pb_grpc.add_WorkerServicer_to_server(ScriptedWorker(s, tokens), server)
            await server.start()
        await gw.start()
        gen = parse({"model": "smollm2", "prompt": "Say it:", "max_tokens": len(tokens), **body}, False, gw.tokenizer,
                    gw.max_model_len, {"smollm2"})
        text, finish, usage = "", None, ()
        async with asyncio.timeout(60):  # a stall that is never noticed fails here, not after an hour
            async for p in gw.generate(gen, "cmpl-1"):
                text += p.text
                finish = p.finish_reason
                usage = (p.prompt_tokens, p.completion_tokens)
        return text, finish, usage, gw
    finally:
        if gw is not None:
            await gw.close()
        for server in servers:
            await server.stop(None)


def moved(reason: str, outcome: str) -> float:
    return m.MIGRATIONS.labels(reason, outcome)._value.get()


def test_a_worker_dying_mid_stream_hands_over_its_tokens():
    first, second = Script(fail_after=4, how="die"), Script()
    before = moved("worker_gone", "resumed")
    text, finish, usage, gw = asyncio.run(serve([first, second], {"min_tokens": 6, "seed": 7, "temperature": 0.5}))
    assert text == TEXT and finish == "length"
    n = len(gw.tokenizer.encode(TEXT))
    assert usage == (len(gw.tokenizer.encode("Say it:")), n)
    call = second.calls[0]  # least_loaded tries the first worker first (ties go by order)
    assert list(call.resume_token_ids) == gw.tokenizer.encode(TEXT)[:4]
    assert call.params.max_tokens == n - 4 and call.params.min_tokens == 2 and call.params.output_offset == 4
    assert call.params.seed == 7 and list(call.prompt_token_ids) == list(first.calls[0].prompt_token_ids)
    assert moved("worker_gone", "resumed") == before + 1


def test_stop_strings_apply_across_the_move():
    first, second = Script(fail_after=3, how="die"), Script()
    text, finish, _, _ = asyncio.run(serve([first, second], {"stop": ["fox jumps"]}))
    assert text == " The quick brown " and finish == "stop"
    assert second.calls  # the stop string straddled the move


def test_a_stall_moves_the_stream():
    first, second = Script(fail_after=2, how="stall"), Script()
    before = moved("stall", "resumed")
    text, finish, _, _ = asyncio.run(serve([first, second], {}, stallSeconds=0.5))
    assert (text, finish) == (TEXT, "length")
    assert moved("stall", "resumed") == before + 1


def test_a_stall_move_doubles_the_request_s_window():
    """Moved for a stall, the request waits twice as long on its next worker: a worker that is slow, not stopped
    (a 0.7 s gap against a 0.5 s window), keeps it. Without the doubling it would move again, and with both
    workers tried it would end with an error."""
    first, second = Script(fail_after=2, how="stall"), Script(fail_after=2, how="pause", pause=0.7)
    before = moved("stall", "resumed")
    text, finish, _, _ = asyncio.run(serve([first, second], {}, stallSeconds=0.5))
    assert (text, finish) == (TEXT, "length")
    assert moved("stall", "resumed") == before + 1 and len(second.calls) == 1


def test_a_moved_stream_whose_next_worker_sends_nothing_moves_again():
    """The worker a stalled stream moved to sends nothing at all (stopped, say): the stream moves on once twice
    its (doubled) window has passed, instead of waiting for that worker's first token for good."""
    first, silent, third = Script(fail_after=2, how="stall"), Script(fail_after=0, how="stall"), Script()
    before = moved("stall", "resumed"), moved("stall", "failed")
    text, finish, _, _ = asyncio.run(serve([first, silent, third], {}, stallSeconds=0.5))
    assert (text, finish) == (TEXT, "length")
    assert len(silent.calls) == 1 and list(silent.calls[0].resume_token_ids)  # it was tried, as a resume
    assert (moved("stall", "resumed"), moved("stall", "failed")) == (before[0] + 1, before[1] + 1)


def test_a_retryable_error_moves_and_a_fatal_one_ends_with_error():
    text, finish, _, _ = asyncio.run(serve([Script(fail_after=2, how="retry"), Script()], {}))
    assert (text, finish) == (TEXT, "length")
    other = Script()
    text, finish, usage, _ = asyncio.run(serve([Script(fail_after=2, how="fatal"), other], {}))
    assert finish == "error" and usage[1] == 2 and TEXT.startswith(text) and not other.calls


def test_a_worker_without_resume_is_never_sent_resume_tokens():
    old = Script(resume=False)
    before = moved("worker_gone", "no_worker")
    text, finish, usage, _ = asyncio.run(serve([Script(fail_after=3, how="die"), old], {}, queueTimeoutSeconds=2))
    assert finish == "error" and usage[1] == 3
    assert all(not c.resume_token_ids for c in old.calls)
    assert moved("worker_gone", "no_worker") == before + 1


def test_moves_stop_at_the_limit():
    scripts = [Script(fail_after=2, how="die"), Script(fail_after=2, how="die"), Script()]
    before = moved("worker_gone", "limit")
    _, finish, usage, _ = asyncio.run(serve(scripts, {}, migrationLimit=1))
    assert finish == "error" and usage[1] == 4 and not scripts[2].calls
    assert moved("worker_gone", "limit") == before + 1
    _, finish, _, _ = asyncio.run(serve([Script(fail_after=2, how="die"), Script()], {}, migrationLimit=0))
    assert finish == "error"


def test_before_the_first_token_a_failure_retries_and_bad_input_never_moves():
    text, finish, _, _ = asyncio.run(serve([Script(fail_after=0, how="die"), Script()], {}, migrationLimit=0))
    assert (text, finish) == (TEXT, "length")  # a retry, not a move: allowed with migrationLimit 0
    with pytest.raises(APIError) as e:
        asyncio.run(serve([Script(fail_after=0, how="fatal"), Script()], {}))
    assert e.value.status == 500
    other = Script()
    with pytest.raises(APIError) as e:
        asyncio.run(serve([Script(fail_after=0, how="invalid"), other], {}))
    assert e.value.status == 400 and not other.calls


def busy_retries() -> float:
    return m.BUSY_RETRIES._value.get()


def test_a_busy_decode_worker_sends_the_request_to_another_one_and_it_is_no_move():
    first, second = Script(busy=1), Script()
    before, moves = busy_retries(), moved("busy", "resumed")
    text, finish, _, _ = asyncio.run(serve([first, second], {}))
    assert (text, finish) == (TEXT, "length")
    assert len(first.calls) == 1 and len(second.calls) == 1 and not second.calls[0].resume_token_ids
    assert busy_retries() == before + 1 and moved("busy", "resumed") == moves


def test_the_only_decode_worker_busy_is_tried_again_until_it_has_room():
    only = Script(busy=3)
    before = busy_retries()
    text, finish, _, _ = asyncio.run(serve([only], {}))
    assert (text, finish) == (TEXT, "length") and len(only.calls) == 4
    assert busy_retries() == before + 3
    # each try after a bounce has an id of its own (the prefill worker may still hold the last one's)
    assert [c.request_id for c in only.calls] == ["cmpl-1", "cmpl-1~1", "cmpl-1~2", "cmpl-1~3"]


def test_workers_busy_past_the_queue_timeout_get_429():
    with pytest.raises(APIError) as e:
        asyncio.run(serve([Script(busy=1 << 20), Script(busy=1 << 20)], {}, queueTimeoutSeconds=0.5))
    assert e.value.status == 429 and e.value.code == "workers_busy" and e.value.headers["Retry-After"]

