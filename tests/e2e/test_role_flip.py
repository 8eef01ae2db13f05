"""Role flips, piece by piece: the flip call checked on the worker's side of the wire and its answer on the
caller's, what makes a flip impossible (`flip_problem`), a worker's registry entry rewritten under its new role
(a real redis-server) with a gateway's view following it in place, and the gateway's POST /admin/flip: its
body checked field by field, the cluster's refusals (colocated, static membership, an unknown worker, a worker
in that role already, the worker's own), and a flip it follows to the end. The worker here is a hand-made
handler behind the real gRPC adapter (its flip rewrites its registry entry as a worker's does); the real
worker's flip, with SmolLM2 and streams running, is tests/e2e/test_role_flip_serving.py."""

from __future__ import annotations

import asyncio
import math

import grpc
import httpx
import pytest
from support.redis_server import RedisServer
from support.serving import free_port

from splitserve.common.config import ClusterSpec
from splitserve.common.membership import StaticMembership
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.server import GrpcWorkerServer
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import Keys, RegistryEntry
from splitserve.common.registry import RedisMembership, Registration
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
from splitserve.router.workers import WorkerSet

pytestmark = pytest.mark.slow

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


# -- the registry and a gateway's view ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis():
    server = RedisServer()
    yield server
    server.close()


async def registered(redis_url: str, name: str, role: str, endpoint: str) -> tuple[RedisLink, Registration]:
    link = RedisLink(redis_url)
    await link.start()
    entry = RegistryEntry(name, f"{name}-instance", role, MODEL, endpoint, "", 16, 100)
    registration = Registration(link, Keys(MODEL), entry, lease_s=5.0)
    await registration.start()
    return link, registration


def test_a_flipped_worker_s_entry_names_its_new_role_and_the_view_follows_in_place(redis):
    async def main() -> None:
        handler = FlipHandler("decode")
        server, endpoint = await serving(handler)
        link, registration = await registered(redis.url, "w-view", "decode", endpoint)
        handler.registration = registration
        reader = RedisLink(redis.url)
        await reader.start()
        membership = RedisMembership(reader, Keys(MODEL))
        await membership.refresh()
        view = WorkerSet(membership)
        try:
            worker = view.get("w-view")
            await view.check(worker)
            assert worker.state == "up" and [w.name for w in view.candidates("decode")] == ["w-view"]

            # mid-flip: the registry still names decode (draining), its health says prefill: starting, not down
            await registration.drain()
            handler.role = "prefill"
            await membership.refresh()
            await view.check(worker)
            assert worker.state == "starting" and not view.candidates("decode")

            await registration.serve_as("prefill")
            await membership.refresh()
            entry = membership.entries()["w-view"]
            assert (entry.role, entry.draining, entry.instance_id) == ("prefill", False, "w-view-instance")
            assert view.get("w-view") is worker  # the same worker, connection and all
            await view.check(worker)
            assert worker.state == "up" and worker.load.role == "prefill" and not worker.load.draining
            assert [w.name for w in view.candidates("prefill")] == ["w-view"] and not view.candidates("decode")
        finally:
            await view.close()
            await registration.close()
            await link.close()
            await reader.close()
            await server.stop(None)

    asyncio.run(main())


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


def test_the_gateway_flips_a_worker_it_knows_and_answers_once_it_sees_it_serving(redis):
    async def main() -> None:
        app = build_app(ClusterSpec.model_validate({"redis": {"mode": "external", "url": redis.url}}))
        gw = app.state.api.gw
        handler = FlipHandler("decode")
        server, endpoint = await serving(handler)
        link, registration = await registered(redis.url, "w-gw", "decode", endpoint)
        handler.registration = registration
        await gw.start()
        try:
            for _ in range(100):  # its first health check
                if gw.workers.get("w-gw") is not None and gw.workers.get("w-gw").state == "up":
                    break
                await asyncio.sleep(0.1)
            r = await post(app, {"worker": "nobody", "role": "prefill"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_worker"
            assert "w-gw" in r.json()["error"]["message"]  # the workers it knows
            r = await post(app, {"worker": "w-gw", "role": "decode"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "same_role" and not handler.calls

            handler.refuse = "its engine (native) is not the one prefill workers run (vllm)"
            r = await post(app, {"worker": "w-gw", "role": "prefill"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "flip_refused"
            assert handler.refuse in r.json()["error"]["message"]

            handler.refuse = None
            r = await post(app, {"worker": "w-gw", "role": "prefill", "drain_seconds": 0})
            assert r.status_code == 200, r.text
            answer = r.json()
            assert (answer["worker"], answer["from"], answer["to"], answer["moved_streams"]) == \
                ("w-gw", "decode", "prefill", 2)
            assert answer["seconds"] >= 0 and answer["worker_seconds"] == 0.25
            assert handler.calls[-1] == FlipCall("prefill", 0.0)
            worker = gw.workers.get("w-gw")  # the gateway's own view had it serving prefill before it answered
            assert worker.info.role == "prefill" and worker.state == "up" and worker.load.available
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
                listed = (await client.get("/health")).json()["workers"]
            assert [(w["name"], w["role"], w["healthy"]) for w in listed] == [("w-gw", "prefill", True)]
        finally:
            await gw.close()
            await registration.close()
            await link.close()
            await server.stop(None)

    asyncio.run(main())
