"""Layer groups (`send_session.LAYER_GROUP`): consecutive layers of a step go as one write, over both backends,
sender and receiver as agents in this process (CPU tensors; NIXL over UCX): the KV lands bit for bit, NIXL makes
fewer transfers, and a group is sent when it is full, at the model's last layer, on a call that does not continue
it, or at `finish`."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.kv_peer import SHAPE, make_kv

from splitserve.kv_transfer import KVLayout, TransferCancelled, TransferTicket, make_agent, send_session

SEED = 1234
LAYERS = SHAPE["num_layers"]  # 6: groups of 4 leave a group of 2
EXPECTED = make_kv(SEED)
SRC = [7, 8, 9, 10, 30, 2, 50, 51]  # runs contiguous on both sides and single blocks
DST = [60, 61, 62, 63, 5, 40, 20, 21]
# (block positions, final) of a chunked prefill's steps (chunks of whole blocks)
STEPS = [(range(0, 3), False), (range(3, 6), False), (range(6, 8), True)]


def _nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def agents(request):
    """(sender, receiver) of one backend, shared by the module's tests (NIXL agents take a while to start)."""
    if request.param == "nixl" and not _nixl_available():
        pytest.fail("NIXL is not installed: `make test` installs it (nixl + nixl-cu13 wheels)")
    recv = make_agent(request.param, KVLayout(make_kv(0, fill=False)))
    send = make_agent(request.param, KVLayout(make_kv(SEED)))
    yield send, recv
    send.close()
    recv.close()


def _xfers(agent) -> int:
    """NIXL write requests the agent posted so far (tcp: 0, it keeps no counts)."""
    return getattr(agent.backend, "counts", {}).get("xfers", 0)


def _stream(agents, rid: str, group: int, steps, monkeypatch, order=None) -> int:
    """Send `steps` layer by layer in `order` (default 0..LAYERS-1) with layer groups of `group`; assert every
    block landed bit for bit; return the NIXL writes it took."""
    send, recv = agents
    monkeypatch.setattr(send_session, "LAYER_GROUP", group)
    for pair in recv.layout.tensors:
        for t in pair:
            t.zero_()
    before = _xfers(send)
    ticket = recv.expect(rid, DST, timeout_s=20)
    session = send.begin(TransferTicket.decode(ticket.encode()), SRC)
    for indices, final in steps:
        for layer in order or range(LAYERS):
            session.send_layer(layer, indices, final)
    session.finish()
    recv.wait_blocking(rid)
    recv.forget(rid)
    for layer in range(LAYERS):
        for kv in (0, 1):
            assert torch.equal(recv.layout.tensors[layer][kv][DST], EXPECTED[layer][kv][SRC]), (rid, layer, kv)
    return _xfers(send) - before


@pytest.mark.parametrize("steps", [[(range(len(SRC)), True)], STEPS], ids=["one-step", "chunked"])
def test_groups_of_four_land_bit_exact_in_fewer_nixl_writes(agents, monkeypatch, steps):
    single = _stream(agents, f"g1-{len(steps)}", 1, steps, monkeypatch)
    grouped = _stream(agents, f"g4-{len(steps)}", 4, steps, monkeypatch)
    if agents[0].backend.name == "nixl":
        assert (single, grouped) == (LAYERS * len(steps), 2 * len(steps))  # per step: layers 0-3, then 4-5


def test_a_call_that_does_not_continue_the_group_sends_it_and_finish_sends_the_rest(agents, monkeypatch):
    # 3, 4, 5 go at the last layer; 0, 1 and 2 wait for a fourth layer that never comes, until finish
    written = _stream(agents, "g4-order", 4, [(range(len(SRC)), True)], monkeypatch, order=[3, 4, 5, 0, 1, 2])
    if agents[0].backend.name == "nixl":
        assert written == 2


def test_abort_drops_the_buffered_group(agents, monkeypatch):
    send, recv = agents
    monkeypatch.setattr(send_session, "LAYER_GROUP", 4)
    ticket = recv.expect("g4-abort", DST, timeout_s=20)
    session = send.begin(TransferTicket.decode(ticket.encode()), SRC)
    for layer in range(3):
        session.send_layer(layer)
    session.abort()
    with pytest.raises(TransferCancelled):
        session.finish()
    assert session.bytes == 0  # nothing was written
    recv.cancel("g4-abort")
    recv.forget("g4-abort")


class _Event:
    """Stands for a CUDA event: records which ones the sender thread waited on."""

    def __init__(self, layer: int, waited: list[int]) -> None:
        self.layer, self.waited = layer, waited

    def synchronize(self) -> None:
        self.waited.append(self.layer)


def test_a_group_waits_on_its_last_layers_event(monkeypatch):
    recv = make_agent("tcp", KVLayout(make_kv(0, fill=False)))
    send = make_agent("tcp", KVLayout(make_kv(SEED)))
    monkeypatch.setattr(send_session, "LAYER_GROUP", 4)
    try:
        ticket = recv.expect("g4-events", DST, timeout_s=20)
        session = send.begin(TransferTicket.decode(ticket.encode()), SRC)
        waited: list[int] = []
        for layer in range(LAYERS):
            session.send_layer(layer, event=_Event(layer, waited))
        session.finish()
        recv.wait_blocking("g4-events")
        assert waited == [3, 5]
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize("raw", ["0", "-2", "four", "1.5", ""])
def test_a_bad_layer_group_fails_at_import(monkeypatch, raw):
    monkeypatch.setenv("SPLITSERVE_NIXL_LAYER_GROUP", raw)
    spec = importlib.util.spec_from_file_location("_send_session_probe", send_session.__file__)
    with pytest.raises(ValueError, match="SPLITSERVE_NIXL_LAYER_GROUP"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))  # a copy: the real module stays
