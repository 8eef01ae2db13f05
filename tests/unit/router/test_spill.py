"""Spilling a long prompt to its decode worker's own prefill while the prefill workers are backed up
(`router.spill`): a real gateway over scripted workers on real gRPC (what the decode worker is told, the counter,
the charge that makes the backlog), and the simulator (a prefill burst served sooner on the same replicas). The
policy wrapper's rule on hand-made worker views is in test_routing.py."""

from __future__ import annotations

import asyncio

import grpc

from splitserve.autoscaler.profile import ReplicaProfile, StepCost
from splitserve.autoscaler.sim.laws import StaticLaw
from splitserve.autoscaler.sim.simulator import SimSettings, fresh, simulate
from splitserve.autoscaler.sim.trace import SimRequest
from splitserve.common.config import ClusterSpec
from splitserve.common.membership import StaticMembership
from splitserve.common.proc import free_port
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.router import metrics as m
from splitserve.router.gateway import Gateway
from splitserve.router.openai_protocol import parse


# -- a real gateway over scripted workers ---------------------------------------------------------------------
class Worker(pb_grpc.WorkerServicer):
    """Answers health as `role`; a Generate call is held until `release` is set, then sends one token."""

    def __init__(self, role: str, release: asyncio.Event) -> None:
        self.role, self.release = role, release
        self.calls: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.calls.append(request)
        await self.release.wait()
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[42], finished=True, finish_reason="length",
                                  prompt_tokens=len(request.prompt_token_ids), completion_tokens=1)

    async def Health(self, request, context):
        return pb.HealthResponse(live=True, ready=True, role=self.role, model="smollm2",
                                 protocol_version=PROTOCOL_VERSION)


async def _two_requests(first_prompt: str, second_prompt: str) -> tuple[list[pb.GenerateRequest], float]:
    """The second request's call while the first is held on the decode worker; (decode calls, spills counted)."""
    spec = ClusterSpec.model_validate({
        "mode": "disaggregated", "decode": {"disaggThreshold": 24},
        "router": {"healthIntervalSeconds": 0.2, "spill": {"prefillBacklogTokens": 32, "localBacklogTokens": 4096}}})
    release = asyncio.Event()
    decode, prefill = Worker("decode", release), Worker("prefill", release)
    servers, endpoints = [], []
    for worker in (decode, prefill):
        server = grpc.aio.server()
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        await server.start()
        servers.append(server)
        endpoints.append(f"127.0.0.1:{port}")
    gw = Gateway(spec, StaticMembership([endpoints[1]], [endpoints[0]]))
    before = m.SPILLS._value.get()
    try:
        await gw.start()

        async def run(prompt: str) -> None:
            gen = parse({"model": "smollm2", "prompt": prompt, "max_tokens": 1}, False, gw.tokenizer,
                        gw.max_model_len, {"smollm2"})
            async for _ in gw.generate(gen, f"cmpl-{len(decode.calls)}"):
                pass

        async with asyncio.timeout(60):
            first = asyncio.create_task(run(first_prompt))
            while not decode.calls:
                await asyncio.sleep(0.01)
            second = asyncio.create_task(run(second_prompt))
            while len(decode.calls) < 2:
                await asyncio.sleep(0.01)
            release.set()
            await asyncio.gather(first, second)
        return decode.calls, m.SPILLS._value.get() - before
    finally:
        await gw.close()
        for server in servers:
            await server.stop(None)


LONG_TEXT = " ".join(f"word{i}" for i in range(40))  # well over 24 tokens: 3+ blocks of 16


def test_a_gateway_spills_while_its_prefill_worker_holds_an_unfinished_prompt():
    calls, spills = asyncio.run(_two_requests(LONG_TEXT, LONG_TEXT + " again"))
    assert calls[0].prefill_worker != ""  # the first went to the prefill worker: its backlog is now > 32 tokens
    assert calls[1].prefill_worker == "" and spills == 1  # the second is prefilled by its decode worker


def test_a_short_prompt_is_charged_to_the_decode_worker_that_computes_it():
    # least_loaded names a prefill worker for every prompt, but a short one is the decode worker's work: it must
    # not count as the prefill worker's backlog (else the long prompt after it would spill)
    short = " ".join(["apple"] * 20)  # 20 tokens: under the threshold of 24, but 2 blocks (32 tokens) of backlog
    calls, spills = asyncio.run(_two_requests(short, LONG_TEXT))
    assert calls[1].prefill_worker != "" and spills == 0


# -- the simulator ----------------------------------------------------------------------------------------------
COST = StepCost(base_s=0.002, per_seq_s=0.0001, per_token_s=0.00005, knee_tokens=20.0, per_ctx_token_s=1e-7,
                per_attn_pair_s=1e-9)
PROFILE = ReplicaProfile(name="toy", cost=COST, kv_capacity_tokens=200_000, kv_bytes_per_token=1000,
                         max_num_seqs=32, max_num_batched_tokens=512, kv_transfer_gbps=1.0,
                         kv_transfer_tail_s=0.002, cold_start_seconds={"native": 5.0})


def test_a_prefill_burst_spills_onto_idle_decode_workers_in_the_simulator():
    burst = [SimRequest(i, 1.0 + 0.001 * i, 1000, 8) for i in range(60)]  # 60k prompt tokens within 60 ms

    def run(spill_tokens: int):
        settings = SimSettings(PROFILE, ttft_s=1.0, itl_s=0.05, disagg_threshold=256, spill_prefill_tokens=spill_tokens,
                               spill_local_tokens=2048)
        return simulate(fresh(burst), settings, StaticLaw(1, 4), (1, 4))

    off, on = run(0), run(4096)
    assert all(r.remote for r in off.requests)
    local = [r for r in on.requests if not r.remote]
    assert 4 <= len(local) < len(burst) and len({r.decode_worker.name for r in local}) == 4
    assert on.attainment() > off.attainment()
    assert max(r.ttft for r in on.requests) < max(r.ttft for r in off.requests)
