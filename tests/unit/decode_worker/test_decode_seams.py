"""The decode service against the seams alone (no model, no transfer, no gRPC): hand-made `ServingEngine`,
`DecodeHandover` and `WorkerClient` show what it asks of each, in which order, and that a failed or abandoned
remote prefill hands its reservation back to the handover together with the prefill call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from splitserve.common.membership import StaticMembership
from splitserve.common.sampling import SamplingParams
from splitserve.common.worker_messages import (
    GenerateCall,
    GenerateChunk,
    PrefillReply,
    RetryReason,
    WorkerCallError,
)
from splitserve.decode_worker.service import DecodeService
from splitserve.engine.interface import ModelFacts, Reservation
from splitserve.engine.outputs import RequestOutput

PROMPT = list(range(10, 74))  # 64 tokens


class Engine:
    facts = ModelFacts("m", 1000, 4096, frozenset(), 1, "cpu", 16, 64)
    dead = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    def add_kv_event_listener(self, listener) -> None:
        pass

    async def generate(self, request_id, prompt_token_ids, params, priority=0) -> AsyncIterator[RequestOutput]:
        self.calls.append(f"generate {request_id}")
        yield RequestOutput(request_id, [7, 8], finished=True, finish_reason="length",
                            num_prompt_tokens=len(prompt_token_ids), num_output_tokens=2)

    async def abort(self, request_id) -> None:
        self.calls.append(f"abort {request_id}")

    def stats(self) -> dict[str, int]:
        return {}

    def shutdown(self) -> None:
        pass


class Handover:
    streams_first_token = False  # a push (native): the prefill's first token goes out once the KV landed
    overlap_reserve = False  # the prefill call goes out after the reservation, with its ticket

    def __init__(self, landed: asyncio.Future | None = None, refuse: str = "") -> None:
        self.calls: list[str] = []
        self.cancelled: list[tuple[str, object]] = []
        self._landed = landed
        self.refuse = refuse
        self.peer: Peer | None = None  # what the prefill peer had seen when the reservation began

    async def reserve(self, request_id, prompt_token_ids, params, priority=0, *, min_remote_tokens=1,
                      timeout_s=30.0) -> Reservation:
        await asyncio.sleep(0.05)  # taking blocks: the early call (if any) is out meanwhile
        self.calls.append(f"reserve {request_id} min={min_remote_tokens}"
                          + (f" peer={self.peer.calls}" if self.peer is not None else ""))
        if self.refuse:
            return Reservation(None, 0, self.refuse)
        return Reservation(b"opaque-ticket", 16)

    async def landed(self, request_id) -> None:
        self.calls.append(f"landed {request_id}")
        if self._landed is not None:
            await self._landed

    async def admit(self, request_id, first_token_id, first_logprob=None, receipt=b"") -> AsyncIterator[RequestOutput]:
        self.calls.append(f"admit {request_id} {first_token_id}" + (f" {receipt.decode()}" if receipt else ""))
        yield RequestOutput(request_id, [first_token_id], num_prompt_tokens=len(PROMPT), num_output_tokens=1)
        yield RequestOutput(request_id, [5], finished=True, finish_reason="length", num_output_tokens=2)

    def cancel(self, request_id, prefill=None) -> None:
        self.calls.append(f"cancel {request_id}")
        self.cancelled.append((request_id, prefill))

    async def close(self) -> None:
        pass


class Peer:
    endpoint = "p:1"

    def __init__(self, fail: WorkerCallError | None = None, hang: bool = False, receipt: bytes = b"") -> None:
        self.fail, self.hang, self.receipt = fail, hang, receipt
        self.tickets: list[bytes] = []
        self.calls: list[str] = []  # "early" (the ticket to follow) or "with ticket"
        self.given_up: list[str] = []

    async def prefill(self, call, timeout_s, ticket=None) -> PrefillReply:
        self.calls.append("early" if ticket is not None else "with ticket")
        try:
            self.tickets.append(call.ticket or await ticket)
        except asyncio.CancelledError:
            self.given_up.append(call.request_id)
            raise
        if self.hang:
            await asyncio.Event().wait()
        if self.fail is not None:
            raise self.fail
        return PrefillReply(42, None, 0, 1234, self.receipt)

    async def close(self) -> None:
        pass


def request(rid: str) -> GenerateCall:
    return GenerateCall(rid, PROMPT, SamplingParams(max_tokens=2, temperature=0), prefill_worker="p:1")


def service(handover: Handover, peer: Peer, engine: Engine) -> DecodeService:
    return DecodeService(engine, handover, StaticMembership(["p:1"], ["d:1"]), threshold=32,
                         connect=lambda endpoint: peer)


async def collect(svc: DecodeService, rid: str) -> list[GenerateChunk]:
    return [r async for r in svc.generate(request(rid))]


def test_a_remote_prefill_carries_the_opaque_ticket_and_admits_after_the_landing():
    engine, handover, peer = Engine(), Handover(), Peer()
    out = asyncio.run(collect(service(handover, peer, engine), "a"))
    assert peer.tickets == [b"opaque-ticket"] and peer.calls == ["with ticket"]
    assert handover.calls == ["reserve a min=32", "landed a", "admit a 42"]
    assert [list(r.token_ids) for r in out] == [[42], [5]] and out[-1].finished and out[0].remote_prefill
    assert out[0].cached_tokens == 16 and engine.calls == [] and not handover.cancelled


class EarlyHandover(Handover):
    overlap_reserve = True  # reserving takes long enough: the call goes out first, its ticket follows


def test_where_reserving_takes_time_the_prefill_call_goes_out_first_and_its_ticket_follows():
    engine, peer = Engine(), Peer()
    handover = EarlyHandover()
    handover.peer = peer
    out = asyncio.run(collect(service(handover, peer, engine), "e"))
    assert handover.calls == ["reserve e min=32 peer=['early']", "landed e", "admit e 42"]
    assert peer.tickets == [b"opaque-ticket"]
    assert [list(r.token_ids) for r in out] == [[42], [5]] and out[0].remote_prefill and not handover.cancelled


def test_no_room_for_the_kv_waits_then_sends_the_request_back_busy_never_prefilling_it_here():
    engine, peer = Engine(), Peer()
    handover = EarlyHandover(refuse="no_free_blocks")
    svc = DecodeService(engine, handover, StaticMembership(["p:1"], ["d:1"]), threshold=32,
                        connect=lambda endpoint: peer, reserve_wait=0.3)
    out = asyncio.run(collect(svc, "f"))
    assert peer.calls == ["early"] and peer.given_up == ["f"] and peer.tickets == []
    assert engine.calls == [] and not handover.cancelled  # nothing prefilled here, nothing reserved to hand back
    assert len(handover.calls) >= 2  # it tried again while it waited
    (busy,) = out
    assert busy.finished and busy.finish_reason == "error" and busy.retry == RetryReason.BUSY and not busy.token_ids


class RoomLater(EarlyHandover):
    """Refuses for want of blocks until `frees` reservations have been tried."""

    def __init__(self, frees: int) -> None:
        super().__init__(refuse="no_free_blocks")
        self.frees = frees

    async def reserve(self, *args, **kwargs) -> Reservation:
        self.frees -= 1
        if self.frees < 0:
            self.refuse = ""
        return await super().reserve(*args, **kwargs)


def test_a_reservation_that_waited_for_room_sends_its_ticket_to_the_early_call():
    engine, peer = Engine(), Peer()
    handover = RoomLater(frees=1)
    out = asyncio.run(collect(service(handover, peer, engine), "g"))
    assert peer.calls == ["early"] and peer.tickets == [b"opaque-ticket"] and not peer.given_up
    assert handover.calls == ["reserve g min=32", "reserve g min=32", "landed g", "admit g 42"]
    assert [list(r.token_ids) for r in out] == [[42], [5]] and out[0].remote_prefill and engine.calls == []


def test_a_mostly_cached_prompt_is_prefilled_here():
    engine, peer = Engine(), Peer()
    out = asyncio.run(collect(service(EarlyHandover(refuse="short_prompt"), peer, engine), "h"))
    assert peer.given_up == ["h"] and engine.calls == ["generate h"] and not out[0].remote_prefill


class PullHandover(Handover):
    """The pull shape (vLLM): admit's stream samples the first token itself, from the prefill's receipt."""

    streams_first_token = True

    async def admit(self, request_id, first_token_id, first_logprob=None, receipt=b"") -> AsyncIterator[RequestOutput]:
        self.calls.append(f"admit {request_id} {receipt.decode()}")
        yield RequestOutput(request_id, [43], num_prompt_tokens=len(PROMPT), num_output_tokens=1)
        yield RequestOutput(request_id, [5], finished=True, finish_reason="length", num_output_tokens=2)


def test_a_pull_sends_the_receipt_and_streams_the_decode_sides_first_token():
    engine, handover, peer = Engine(), PullHandover(), Peer(receipt=b'{"where": "p"}')
    out = asyncio.run(collect(service(handover, peer, engine), "p"))
    assert handover.calls == ["reserve p min=32", "landed p", 'admit p {"where": "p"}']
    # the prefill's token (42) is not sent ahead: the decode side's first token is the stream's first
    assert [list(r.token_ids) for r in out] == [[43], [5]] and out[-1].finished and out[0].remote_prefill
    assert engine.calls == [] and not handover.cancelled


def test_a_failed_prefill_hands_the_reservation_back_with_the_ended_call_and_prefills_locally():
    engine, handover, peer = Engine(), Handover(), Peer(fail=WorkerCallError("unavailable", "gone"))
    out = asyncio.run(collect(service(handover, peer, engine), "b"))
    assert [c for c in handover.calls if c.startswith("cancel")] == ["cancel b"]
    (rid, call), = handover.cancelled
    assert rid == "b" and call.done()  # the handover frees the blocks only after this call ended
    assert engine.calls == ["generate b#local"]  # a new engine id: the reservation is the handover's
    assert [list(r.token_ids) for r in out] == [[7, 8]] and out[0].request_id == "b"


def test_a_caller_leaving_during_the_prefill_hands_the_reservation_back():
    engine, handover, peer = Engine(), Handover(), Peer(hang=True)

    async def main():
        task = asyncio.ensure_future(collect(service(handover, peer, engine), "c"))
        while not peer.tickets:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        (rid, call), = handover.cancelled
        await asyncio.wait({call}, timeout=1)
        return rid, call

    rid, call = asyncio.run(main())
    assert rid == "c" and call.cancelled()
    assert engine.calls == []
