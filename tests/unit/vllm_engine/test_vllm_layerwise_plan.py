"""The layerwise connector's plain-Python parts, without a vLLM server: the scheduler side's planner with
hand-made requests, every wire format validated off the wire, UCX's transport tables parsed from lines a real UCX
wrote, and the control line between a worker and the connectors inside its server over real ZMQ on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from splitserve.common.proc import free_port
from splitserve.vllm_engine.control import ControlServer
from splitserve.vllm_engine.in_vllm.control_link import ControlLink
from splitserve.vllm_engine.in_vllm.layerwise_plan import LayerwisePlanner
from splitserve.vllm_engine.in_vllm.layerwise_wire import (
    AgentInfo,
    LayerwiseSettings,
    LayerwiseTicket,
    Region,
    WireError,
    abort_notice,
    decode_message,
    done_notice,
    encode_message,
    parse_notice,
    request_params,
)
from splitserve.vllm_engine.in_vllm.ucx_transport import classify, parse

BS = 16


def planner() -> tuple[LayerwisePlanner, list[tuple[str, dict]]]:
    sent: list[tuple[str, dict]] = []
    return LayerwisePlanner(BS, "eng", 0, 1, lambda kind, **f: sent.append((kind, f))), sent


def consumer(key: str = "k1", deadline: float | None = None) -> dict:
    return request_params("consumer", key, time.time() + 60 if deadline is None else deadline)


# == the scheduler side ==========================================================================================
def test_a_consumer_is_parked_with_every_token_past_its_local_hit_and_its_blocks_are_published():
    p, sent = planner()
    # 100 prompt tokens, 32 of them in vLLM's cache: the other 68 arrive (the last one vLLM recomputes itself)
    assert p.lookup("r", consumer(), 100, 32) == (68, True)
    assert p.lookup("r", consumer(), 100, 32) == (68, True)  # asked again before allocation: the same answer
    p.allocated("r", consumer(), [7, 8, 9, 10, 11, 12, 13], 68, 100)
    assert sent == [("reserved", {"key": "k1", "engine": "eng", "dp": 0, "tp": 1, "first_block": 2,
                                  "block_ids": [9, 10, 11, 12, 13], "num_tokens": 100})]
    plan = p.step([], [])
    (r,) = plan.reservations
    assert (r.req_id, r.key, r.block_ids) == ("r", "k1", (9, 10, 11, 12, 13)) and not plan.producers
    assert p.step([], []).reservations == []  # handed to the worker side once
    # resumed after a preemption: it computes the rest itself
    assert p.lookup("r", consumer(), 100, 0) == (0, False)
    assert p.finished("r") is False  # vLLM holds a waiting consumer's blocks itself


def test_what_is_not_a_live_consumer_is_computed_locally():
    p, sent = planner()
    assert p.lookup("a", None, 100, 0) == (0, False)
    assert p.lookup("b", {"do_remote_prefill": True}, 100, 0) == (0, False)  # not ours
    assert p.lookup("c", {"splitserve_layerwise": {"role": "consumer", "key": "has space"}}, 100, 0) == (0, False)
    assert p.lookup("d", consumer(deadline=time.time() - 1), 100, 0) == (0, False)  # its deadline passed
    assert p.lookup("e", request_params("producer", "p"), 100, 0) == (0, False)
    # vLLM took the prompt from its own cache after all (nothing external): the worker is told, with no blocks
    p.lookup("f", consumer("kf"), 100, 0)
    p.allocated("f", consumer("kf"), [1, 2, 3, 4, 5, 6, 7], 0, 100)
    assert sent == [("reserved", {"key": "kf", "engine": "eng", "dp": 0, "tp": 1, "first_block": 0, "block_ids": [],
                                  "num_tokens": 0})]
    assert p.step([], []).reservations == []


def test_a_producer_is_planned_chunk_by_chunk_and_keeps_its_blocks_once_it_ran():
    p, sent = planner()
    params = request_params("producer", "p1")
    p.allocated("r", params, [1, 2, 3], 0, 100)
    assert sent == []  # a producer publishes nothing: its ticket comes from the worker
    first = p.step([("r", 0, 48, [1, 2, 3])], [])
    (pp,) = first.producers
    assert (pp.key, pp.block_ids, pp.start, pp.end, pp.num_prompt) == ("p1", (1, 2, 3), 0, 48, 100)
    second = p.step([], [("r", 48, 52, [4, 5, 6, 7], False)])
    assert second.producers[0].block_ids == (1, 2, 3, 4, 5, 6, 7) and second.producers[0].end == 100
    assert p.step([], [("r", 100, 1, None, False)]).producers == []  # decoding past the prompt: nothing to send
    resumed = p.step([], [("r", 0, 100, [9, 10, 11, 12, 13, 14, 15], True)])  # preempted: new blocks
    assert resumed.producers[0].block_ids == (9, 10, 11, 12, 13, 14, 15)
    assert p.finished("r") is True and p.num_tracked == 0
    p.allocated("q", request_params("producer", "p2"), [1], 0, 10)
    assert p.finished("q") is False  # never ran: vLLM frees its blocks at once


# == wire formats =================================================================================================
def ticket(**over) -> LayerwiseTicket:
    fields = dict(key="r.1", engine="e-1", dp_rank=0, tp_size=1, host="10.0.0.5", port=5600, block_size=BS,
                  first_block=2, block_ids=(9, 10, 11, 12, 13), num_tokens=100, deadline=time.time() + 30)
    return LayerwiseTicket(**{**fields, **over})


def test_tickets_round_trip_and_what_does_not_fit_is_refused_with_the_field():
    t = ticket()
    assert LayerwiseTicket.decode(t.encode()) == t and LayerwiseTicket.from_json(t.to_json()) == t
    assert t.rank_endpoint(0) == "tcp://10.0.0.5:5600" and ticket(dp_rank=1, tp_size=2).rank_endpoint(1) == \
        "tcp://10.0.0.5:5603"
    raw = json.loads(t.encode())
    cases = {"not JSON": b"{", "another engine": json.dumps({**raw, "handover": "vllm-pull"}).encode(),
             "version": json.dumps({**raw, "v": 2}).encode(),
             "block ids for": json.dumps({**raw, "block_ids": [1, 2]}).encode(),
             "ticket.port": json.dumps({**raw, "port": 0}).encode(),
             "ticket.key": json.dumps({**raw, "key": "a|b"}).encode(),
             "ticket.host": json.dumps({**raw, "host": "evil host"}).encode(),
             "unknown": json.dumps({**raw, "extra": 1}).encode(),
             "ticket.block_ids": json.dumps({**raw, "block_ids": [1, -2, 3, 4, 5]}).encode()}
    for why, bad in cases.items():
        with pytest.raises(WireError, match=why):
            LayerwiseTicket.decode(bad)


def test_control_messages_and_notices_are_checked_field_by_field():
    raw = encode_message("landed", key="k", ok=True, bytes=10, reason="", rank=0)
    assert decode_message(raw) == ("landed", {"key": "k", "ok": True, "bytes": 10, "reason": "", "rank": 0})
    with pytest.raises(WireError):
        encode_message("landed", key="k")  # fields missing: a bug here, not a message
    for bad in (b"[]", b'{"t": "landed", "v": 1}', b'{"t": "nope", "v": 1}',
                json.dumps({"t": "drop", "v": 1, "key": 5}).encode(),
                json.dumps({"t": "landed", "v": 1, "key": "k", "ok": 1, "bytes": 1, "reason": "", "rank": 0}).encode(),
                json.dumps({"t": "reserved", "v": 1, "key": "k", "engine": "e", "dp": 0, "tp": 1, "first_block": 0,
                            "block_ids": ["x"], "num_tokens": 1}).encode(),
                json.dumps({"t": "drop", "v": 9, "key": "k"}).encode()):
        with pytest.raises(WireError):
            decode_message(bad)
    assert parse_notice(done_notice("k.1", 4096)) == ("D", "k.1", 4096, "")
    assert parse_notice(abort_notice("k.1", "peer | gone")) == ("A", "k.1", 0, "peer / gone")
    for other in (b"L|-1|1|0|0|1|req", b"ssL1|D|k|-1", b"ssL1|X|k|0", b"\xff", b"ssL1|D|k"):
        assert parse_notice(other) is None  # another sender's, or not ours to trust


def test_agent_info_and_settings_round_trip(monkeypatch):
    info = AgentInfo("ss-e-dp0-tp0", b"\x00meta", "DRAM", 0, 2,
                     (Region(4096, 512, 512, 10), Region(8192, 512, 512, 10)) * 3)
    back = AgentInfo.decode(info.encode())
    assert back == info and back.num_layers == 3 and back.shape() == (3, (512, 512))
    with pytest.raises(WireError, match="regions"):
        AgentInfo.decode(json.dumps({**json.loads(info.encode()), "regions_per_layer": 4}).encode())
    with pytest.raises(WireError, match="mem_type"):
        AgentInfo.decode(json.dumps({**json.loads(info.encode()), "mem_type": "HBM"}).encode())
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5700")
    s = LayerwiseSettings.from_extra(LayerwiseSettings("tcp://127.0.0.1:5558").to_extra())
    assert (s.side_channel_host, s.side_channel_port, s.layer_group) == ("10.1.2.3", 5700, 1)
    for bad in ({"control": "ipc:///x"}, {"control": "tcp://h:1", "layer_group": 0}, {"control": "tcp://h:1", "x": 1},
                {}):
        with pytest.raises(ValueError):
            LayerwiseSettings.from_extra({"splitserve_layerwise": bad})


# == UCX's transport tables =======================================================================================
UCX_LOG = """\
[1795909864.884227] [vm:12018:0]   +--------+-------------+-----------------------------------+
[1795909864.884227] [vm:12018:0]   | ss-644778bd-0573-46d9-9fdc-bc31 self cfg#0               |
[1795909864.884227] [vm:12018:0]   | remote memory write by ucp_put* from host memory to host |
[1795909864.884227] [vm:12018:0]   +--------+-------------+-----------------------------------+
[1795909864.884227] [vm:12018:0]   | Range  | Description |              Config               |
[1795909864.884227] [vm:12018:0]   +--------+-------------+-----------------------------------+
[1795909864.884227] [vm:12018:0]   | 0..inf | zero-copy   | tcp/lo                            |
[1795909864.884227] [vm:12018:0]   +--------+-------------+-----------------------------------+
[1795909865.050426] [vm:12018:0]   +--------+-------------+-----------------------------------+
[1795909865.050426] [vm:12018:0]   | ss-644778bd-0573-46d9-9fdc-bc31 intra-node cfg#1         |
[1795909865.050426] [vm:12018:0]   | active message by ucp_am_send* from host memory          |
[1795909865.050426] [vm:12018:0]   | 0..inf | zero-copy   | tcp/lo                            |
[1795909865.056206] [vm:12018:0]   +--------+-------------+-----------------------------------+
[1795909865.056206] [vm:12018:0]   | ss-644778bd-0573-46d9-9fdc-bc31 intra-node cfg#1         |
[1795909865.056206] [vm:12018:0]   | remote memory write by ucp_put* from cuda memory to cuda |
[1795909865.056206] [vm:12018:0]   +----------+-------------+---------------------------------+
[1795909865.056206] [vm:12018:0]   |  0..8191 | short       | cuda_ipc/cuda                   |
[1795909865.056206] [vm:12018:0]   | 8192..inf | zero-copy  | 50% on rc_mlx5/mlx5_0:1 and 50% on tcp/eth0 |
[1795909865.056206] [vm:12018:0]   +----------+-------------+---------------------------------+
"""


def test_ucx_put_tables_name_the_transport_of_the_largest_messages():
    tables = parse(UCX_LOG.splitlines())
    assert [(t.scope, t.src_mem, t.transport) for t in tables] == [("self", "host", "tcp"), ("intra-node", "cuda", "tcp")]
    assert tables[1].worker == "ss-644778bd-0573-46d9-9fdc-bc31" and tables[1].config == 1
    assert [classify(x) for x in ("cuda_ipc/cuda", "rc_mlx5/mlx5_0:1", "tcp/eth0", "cma/memory", "dc_mlx5/mlx5_1:1",
                                  "", "gdr_copy/cuda")] == ["cuda_ipc", "rdma", "tcp", "shm", "rdma", "unknown",
                                                            "gdr_copy"]


# == the control line ==============================================================================================
def test_the_control_line_carries_hellos_tickets_and_reports_both_ways(caplog):
    async def main() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        server = ControlServer(endpoint, tp_size=2)
        server.start()
        got: list[tuple[str, dict]] = []
        ranks = [ControlLink(endpoint, "worker", 0, r, "eng", lambda k, f: got.append((k, f))) for r in (0, 1)]
        sched = ControlLink(endpoint, "scheduler", 0, 0, "eng", None)
        try:
            deadline = time.monotonic() + 30
            while not (server.connected() and len(server.workers()) == 2):
                assert time.monotonic() < deadline, "no hellos"
                await asyncio.sleep(0.05)
            reserved = server.expect_reserved("k")
            landed = server.expect("landed", "k")
            sched.send("reserved", key="k", engine="eng", dp=0, tp=2, first_block=1, block_ids=[4, 5], num_tokens=40)
            assert (await asyncio.wait_for(reserved, 10))["block_ids"] == [4, 5]
            ranks[0].send("landed", key="k", ok=True, bytes=100, reason="", rank=0)
            await asyncio.sleep(0.2)
            assert not landed.done()  # every rank must say so
            ranks[1].send("landed", key="k", ok=True, bytes=50, reason="", rank=1)
            assert await asyncio.wait_for(landed, 10) == (True, 150, "")
            failed = server.expect("sent", "j")
            ranks[1].send("sent", key="j", ok=False, bytes=0, reason="gone", rank=1)
            assert await asyncio.wait_for(failed, 10) == (False, 0, "gone")  # one failed rank ends it
            assert await server.to_workers("ticket", key="p", ticket=ticket().to_json()) == 2
            while len(got) < 2:
                assert time.monotonic() < deadline, got
                await asyncio.sleep(0.05)
            assert {k for k, _ in got} == {"ticket"} and LayerwiseTicket.from_json(got[0][1]["ticket"]).key == "r.1"
            ranks[0].send("transport", peer="a", host="10.0.0.5:5600", transport="tcp", local_mem="VRAM",
                          remote_mem="VRAM", rank=0)
            while "10.0.0.5:5600" not in server.transports:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert caplog.text.count("two GPU workers exchange KV over TCP") == 1  # warned, once
            ranks[1].send("transport", peer="b", host="10.0.0.6:5600", transport="tcp", local_mem="VRAM",
                          remote_mem="VRAM", rank=1)
            ranks[0].send("dropped", peer="a", host="10.0.0.5:5600", rank=0)
            while "10.0.0.5:5600" in server.transports or "10.0.0.6:5600" not in server.transports:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert caplog.text.count("two GPU workers exchange KV over TCP") == 1
        finally:
            for link in [*ranks, sched]:
                link.close()
            await server.close()

    asyncio.run(main())
