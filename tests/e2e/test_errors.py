"""Errors that say what failed: a Redis link degrades only when Redis cannot be reached (a bug raises) and never
keeps a cancelled caller going, and an unknown or misspelled routing setting is refused with one line naming it."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner
from redis.exceptions import ResponseError
from support.redis_server import RedisServer
from support.serving import free_port

from splitserve.common.redis_link import RedisLink
from splitserve.router.policy import PolicyError, make_policy, policy_settings

pytestmark = pytest.mark.slow


async def _link(url: str) -> RedisLink:
    link = RedisLink(url, timeout=0.5, retry_s=0.1)
    await link.start()
    return link


def test_a_call_redis_answers_with_an_error_raises_and_keeps_the_link_up(redis):
    async def main() -> None:
        link = await _link(redis.url)
        try:
            assert link.up
            assert await link.call(lambda r: r.set("k", "v")) is True
            with pytest.raises(ResponseError, match="WRONGTYPE"):
                await link.call(lambda r: r.lpush("k", "x"), "default")  # a wrong command for the key's type
            with pytest.raises(ResponseError):
                await link.call(lambda r: r.execute_command("NOSUCHCOMMAND"))
            with pytest.raises(TypeError):
                await link.call(lambda r: r.get())  # a bug in the caller
            assert link.up and link.failures == 0
            assert await link.call(lambda r: r.get("k")) == b"v"
        finally:
            await link.close()

    asyncio.run(main())


def test_a_cancel_that_lands_as_a_call_is_answered_still_ends_the_caller(redis):
    """The gateway's loops call Redis through the link and end when cancelled. A cancel that lands in the same turn
    as the call's answer must end the caller too: Python 3.11's wait_for returned the answer and dropped such a
    cancel, the loop went on, and a gateway sent SIGTERM never exited."""
    async def main() -> None:
        link = await _link(redis.url)
        answer = asyncio.get_running_loop().create_future()

        async def slow(r) -> str:
            await r.set("asked", "1")
            return await answer

        try:
            caller = asyncio.get_running_loop().create_task(link.call(slow))
            for _ in range(200):
                if await link.call(lambda r: r.get("asked")) == b"1":
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the caller now waits on its answer
            answer.set_result("answered")
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            assert link.up and await link.call(lambda r: r.get("asked")) == b"1"
        finally:
            await link.close()

    asyncio.run(main())


def test_an_unreachable_redis_degrades_to_the_default():
    async def main() -> None:
        server = RedisServer()
        link = await _link(server.url)
        try:
            assert link.up
            server.stop()  # SIGKILL: connections reset, then refused
            got = await link.call(lambda r: r.get("k"), "default")
            assert got == "default"
            assert not link.up and link.failures == 1
            assert await link.call(lambda r: r.get("k"), "down") == "down"  # no call while down
        finally:
            await link.close()
            server.close()

    asyncio.run(main())


def test_a_restarted_redis_is_reached_once_and_the_link_stays_up():
    """Calls in parallel leave several connections in the client's pool. After Redis restarts, the link comes
    back on a new client: no call lands on a connection to the server that died, so the link stays up."""
    async def main() -> None:
        server = RedisServer()
        link = await _link(server.url)
        ups = 0

        async def counted() -> None:
            nonlocal ups
            ups += 1

        link.on_up(counted)
        try:
            await asyncio.gather(*(link.call(lambda r: r.blpop(["nothing"], timeout=0.2)) for _ in range(6)))
            server.stop()  # SIGKILL
            assert await link.call(lambda r: r.get("k"), "default") == "default"
            server.start()  # the same port
            for _ in range(100):
                if link.up:
                    break
                await asyncio.sleep(0.1)
            assert link.up and ups == 1
            failures = link.failures
            for _ in range(3):
                got = await asyncio.gather(*(link.call(lambda r: r.blpop(["nothing"], timeout=0.1), "down")
                                             for _ in range(6)))
                assert got == [None] * 6
            assert link.up and link.failures == failures and ups == 1
        finally:
            await link.close()
            server.close()

    asyncio.run(main())


def test_a_redis_that_never_answers_is_unreachable_not_a_bug():
    async def main() -> None:
        link = RedisLink(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
        await link.start()
        try:
            assert not link.up
            assert await link.call(lambda r: r.get("k"), 7) == 7
        finally:
            await link.close()

    asyncio.run(main())


def test_unknown_policy_is_refused_with_the_valid_ones():
    with pytest.raises(PolicyError) as e:
        make_policy("kv_awre")
    msg = str(e.value)
    assert "\n" not in msg
    assert "'kv_awre'" in msg and "did you mean 'kv_aware'" in msg
    assert "least_loaded, round_robin, kv_aware" in msg


def test_misspelled_policy_setting_is_refused():
    with pytest.raises(PolicyError) as e:
        make_policy("kv_aware", source=None, overlap_weigth=2.0)
    msg = str(e.value)
    assert "\n" not in msg
    assert "unknown routing setting 'overlap_weigth'" in msg and "did you mean 'overlap_weight'" in msg
    for name in ("overlap_weight", "decode_weight", "pool_credit", "session_slack", "threshold"):
        assert name in msg


def test_settings_of_another_policy_pass_over():
    """One call site serves every policy: a setting kv_aware takes is not an error for least_loaded."""
    assert "overlap_weight" in policy_settings()
    assert make_policy("least_loaded", overlap_weight=2.0, threshold=64).name == "least_loaded"
    assert make_policy("kv_aware", source=None, overlap_weight=2.0).overlap_weight == 2.0


def test_the_router_command_turns_a_policy_error_into_one_line(monkeypatch):
    import splitserve.router.app as app_module
    from splitserve.cli import app

    async def serve(spec, host):  # what building the gateway does with a misspelled setting
        make_policy(spec.router.policy, overlap_weigth=1.0)

    monkeypatch.setattr(app_module, "serve", serve)
    res = CliRunner().invoke(app, ["router", "--decode", "127.0.0.1:1"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitserve: error: unknown routing setting 'overlap_weigth'")


def test_an_event_stream_deleted_under_a_gateway_means_a_rebuild_not_a_bug(redis):
    """XINFO on a stream that is gone is an error reply Redis gives for a reason: the index fell behind."""
    from splitserve.router.cluster import ClusterState

    async def main() -> None:
        link = await _link(redis.url)
        try:
            state = ClusterState(link, "fuzz-model")
            state.last_id = "5-0"  # it had read the stream
            redis.cli("del", state.keys.events)
            assert await state._behind() is True
            assert link.up
        finally:
            await link.close()

    asyncio.run(main())
