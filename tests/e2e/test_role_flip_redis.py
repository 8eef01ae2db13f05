"""Role flips against a real redis-server: a flipped worker's registry entry names its new role and the gateway's
view follows in place; the gateway flips a worker it knows and answers once it sees it serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from unit.router.test_role_flip import MODEL, FlipHandler, post, serving

from splitserve.common.config import ClusterSpec
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import Keys, RegistryEntry
from splitserve.common.registry import RedisMembership, Registration
from splitserve.common.worker_messages import (
    FlipCall,
)
from splitserve.router.app import build_app
from splitserve.router.workers import WorkerSet

pytestmark = pytest.mark.slow


# -- the registry and a gateway's view ---------------------------------------------------------------------------
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
