"""Role flips, piece by piece: the flip call checked on the worker's side of the wire and its answer on the
caller's, what makes a flip impossible (`flip_problem`), and the gateway's POST /admin/flip: its body checked
field by field and a colocated cluster's refusal. The worker here is a hand-made handler behind the real gRPC
adapter; with a real redis-server (the registry entry rewritten, the gateway's view following it, a flip
followed to the end) in tests/e2e/test_role_flip_redis.py; the real worker's flip, with SmolLM2 and streams
running, is tests/e2e/test_role_flip_serving.py."""

from __future__ import annotations

import asyncio
import math

import grpc
import httpx
import pytest
from support.serving import free_port

from splitserve.common.config import ClusterSpec
from splitserve.common.membership import StaticMembership
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.server import GrpcWorkerServer
from splitserve.common.registry import Registration
from splitserve.common.role_flips import flip_problem
from splitserve.common.worker_client import GrpcWorkerClient
from splitserve.common.worker_messages import (
    FlipCall,
    FlipRefused,
    FlipReply,
    HealthReport,
    LoadReport,
    WorkerCallError,
)
from splitserve.router.app import build_app

MODEL = "smollm2"


class FlipHandler:
    """A worker's calls as far as a flip goes: its health names its role, and its flip rewrites its registry
    entry (draining, then the new role) as `splitserve.worker` does."""

    def __init__(self, role: str, registration: Registration | None = None) -> None:
        self.role = role
        self.registration = registration
        self.calls: list[FlipCall] = []
        self.refuse: str | None = None  # a FlipRefused message to answer with
        self.bogus = False  # answer with a role that is none

    def health(self) -> HealthReport:
        return HealthReport(True, True, self.role, False, MODEL, PROTOCOL_VERSION)

    def load(self) -> LoadReport:
        return LoadReport(0, 0, 0, 0, 0, 0, 0, 0)

    async def flip(self, call: FlipCall) -> FlipReply:
        self.calls.append(call)
        if self.refuse:
            raise FlipRefused(self.refuse)
        if self.bogus:
            return FlipReply("both", self.role, 0.1, 0)
        if call.role == self.role:
            raise FlipRefused(f"it serves {call.role} already")
        previous = self.role
        if self.registration is not None:
            await self.registration.drain()
        self.role = call.role
        if self.registration is not None:
            await self.registration.serve_as(call.role)
        return FlipReply(call.role, previous, 0.25, 2)


async def serving(handler: FlipHandler) -> tuple[GrpcWorkerServer, str]:
    server = GrpcWorkerServer(handler)
    endpoint = f"127.0.0.1:{free_port()}"
    await server.start(endpoint)
    return server, endpoint


# -- the wire ---------------------------------------------------------------------------------------------------
def test_a_flip_call_that_fails_validation_never_reaches_the_worker():
    async def main() -> None:
        handler = FlipHandler("decode")
        server, endpoint = await serving(handler)
        channel = grpc.aio.insecure_channel(endpoint)
        stub = pb_grpc.WorkerStub(channel)
        try:
            for request, field in ((pb.FlipRequest(protocol_version=PROTOCOL_VERSION, role="both"), "role"),
                                   (pb.FlipRequest(protocol_version=PROTOCOL_VERSION, role=""), "role"),
                                   (pb.FlipRequest(protocol_version=PROTOCOL_VERSION, role="prefill",
                                                   drain_seconds=-1), "drain_seconds"),
                                   (pb.FlipRequest(protocol_version=PROTOCOL_VERSION, role="prefill",
                                                   drain_seconds=math.nan), "drain_seconds"),
                                   (pb.FlipRequest(protocol_version=PROTOCOL_VERSION, role="prefill",
                                                   drain_seconds=1e5), "drain_seconds"),
                                   (pb.FlipRequest(protocol_version=0, role="prefill"), "protocol_version")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Flip(request, timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), request
            assert handler.calls == []
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(main())


def test_a_flip_s_answer_and_refusal_reach_the_caller_as_sent():
    async def main() -> None:
        handler = FlipHandler("decode")
        server, endpoint = await serving(handler)
        client = GrpcWorkerClient(endpoint)
        try:
            reply = await client.flip(FlipCall("prefill", 0.5), timeout_s=10)
            assert reply == FlipReply("prefill", "decode", 0.25, 2)
            assert handler.calls == [FlipCall("prefill", 0.5)]
            with pytest.raises(WorkerCallError) as e:  # the worker's refusal, its message intact
                await client.flip(FlipCall("prefill", 0.5), timeout_s=10)
            assert e.value.kind == "refused" and e.value.details == "it serves prefill already"
            handler.bogus = True  # an answer that is not a flip's is refused on the caller's side
            with pytest.raises(WorkerCallError) as e:
                await client.flip(FlipCall("decode", 0.5), timeout_s=10)
            assert e.value.kind == "failed" and "does not validate" in e.value.details
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(main())


def test_what_makes_a_flip_impossible():
    spec = ClusterSpec.model_validate({"redis": {"mode": "external", "url": "redis://127.0.0.1:1/0"}})
    assert flip_problem(spec, "decode", "prefill", True) is None
    assert flip_problem(spec, "prefill", "decode", True) is None
    assert "serves prefill already" in flip_problem(spec, "prefill", "prefill", True)
    assert "Redis registry" in flip_problem(spec, "decode", "prefill", False)
    colocated = ClusterSpec.model_validate({"mode": "colocated"})
    assert "colocated" in flip_problem(colocated, "both", "prefill", True)
    vllm = ClusterSpec.model_validate({"engine": "vllm"})  # kv_role kv_both: the same server either way
    assert flip_problem(vllm, "decode", "prefill", True) is None


# -- the gateway's POST /admin/flip ------------------------------------------------------------------------------
async def post(app, body) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        return await client.post("/admin/flip", json=body)


def test_the_flip_body_is_checked_field_by_field():
    async def main() -> None:
        app = build_app(ClusterSpec(), membership=StaticMembership([], ["127.0.0.1:1"]))
        for body, param in (([], None), ({}, "worker"), ({"worker": "", "role": "prefill"}, "worker"),
                            ({"worker": "w", "role": "both"}, "role"),
                            ({"worker": "w", "role": "prefill", "drain_seconds": -1}, "drain_seconds"),
                            ({"worker": "w", "role": "prefill", "drain_seconds": "1"}, "drain_seconds"),
                            ({"worker": "w", "role": "prefill", "timeout_seconds": 0}, "timeout_seconds"),
                            ({"worker": "w", "role": "prefill", "timeout_seconds": True}, "timeout_seconds"),
                            ({"worker": "w", "role": "prefill", "force": True}, "force")):
            r = await post(app, body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())
        r = await post(app, {"worker": "w", "role": "prefill"})  # valid, but this cluster has no registry
        assert r.status_code == 409 and r.json()["error"]["code"] == "no_registry"

    asyncio.run(main())


def test_a_colocated_cluster_has_no_role_to_flip_to():
    async def main() -> httpx.Response:
        spec = ClusterSpec.model_validate({"mode": "colocated"})
        return await post(build_app(spec, membership=StaticMembership([], ["h:1"])), {"worker": "h:1", "role": "prefill"})

    r = asyncio.run(main())
    assert r.status_code == 409 and r.json()["error"]["code"] == "colocated"
