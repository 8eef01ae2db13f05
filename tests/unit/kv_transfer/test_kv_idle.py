"""A transfer agent at rest costs (almost) no CPU, for each backend, and still wakes at once for new work.

A receiver and a sender, in this process, first move one request and leave a second sender session open with
nothing in flight (a stalled prefill); then both idle while the CPU time of every thread they started (native
ones such as UCX's included) is measured, and a last transfer checks that rest did not cost latency. Polling
is allowed only while a transfer is in flight. Threads older than the test (pytest's, other tests') are left
out of the sum, so that it holds inside a full test run too.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from support.kv_peer import SHAPE, make_kv

from splitserve.kv_transfer import KVLayout, KVTransferAgent, SendSession, TransferTicket, make_agent

IDLE_S = 5.0  # seconds of rest measured
MAX_IDLE_CPU = 0.03  # of one core, over the idle window: the agents' threads together
SEED = 77


def _nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


def _thread_cpu_s() -> dict[int, tuple[str, float]]:
    """Thread id -> (Python name, 'native' for threads of libraries such as UCX; CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        utime, stime = int(fields[11]), int(fields[12])  # clock ticks
        out[int(tid)] = (names.get(int(tid), "native"), (utime + stime) / tick)
    return out


def _send(receiver: KVTransferAgent, sender: KVTransferAgent, rid: str, src: list[int], dst: list[int],
          finish: bool = True) -> SendSession:
    ticket = receiver.expect(rid, dst, timeout_s=20)
    session = sender.begin(TransferTicket.decode(ticket.encode()), src)
    for layer in range(SHAPE["num_layers"]):
        session.send_layer(layer)
    if finish:
        session.finish()
    return session


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_idle_agent_uses_under_3_percent_of_a_core(backend):
    if backend == "nixl" and not _nixl_available():
        pytest.skip("NIXL is not installed")
    older = set(_thread_cpu_s())  # threads not ours
    receiver = make_agent(backend, KVLayout(make_kv(0, fill=False)))
    sender = make_agent(backend, KVLayout(make_kv(SEED)))
    stalled = None
    try:
        # used before resting: connections and the remote agent exist
        _send(receiver, sender, "warm", [1, 2, 3], [10, 11, 12])
        receiver.wait_blocking("warm")
        # a session that stays open with every write done (a prefill that stalled): must not be polled
        stalled = _send(receiver, sender, "stalled", [4, 5], [20, 21], finish=False)
        receiver.wait_blocking("stalled")
        time.sleep(0.5)  # idle backoffs reach their longest sleep

        threads0, process0, t0 = _thread_cpu_s(), time.process_time(), time.monotonic()
        time.sleep(IDLE_S)
        threads1, process1, wall = _thread_cpu_s(), time.process_time(), time.monotonic() - t0
        used = {f"{name} {tid}": cpu - threads0.get(tid, (name, 0.0))[1]
                for tid, (name, cpu) in threads1.items() if tid not in older}  # CPU seconds in the window
        cpu = sum(used.values()) / wall  # cores
        busiest = sorted(used.items(), key=lambda kv: -kv[1])[:4]
        assert cpu < MAX_IDLE_CPU, (f"{backend} at rest: its threads used {cpu:.1%} of a core (whole process "
                                    f"{(process1 - process0) / wall:.1%}); busiest (CPU s): {busiest}")

        # rest costs no latency: a new ticket wakes the pollers at once
        src, dst = [30, 31, 32, 33], [40, 41, 42, 43]
        t0 = time.monotonic()
        _send(receiver, sender, "after", src, dst)
        receiver.wait_blocking("after")
        assert time.monotonic() - t0 < 2.0
        want = make_kv(SEED)
        for layer in range(SHAPE["num_layers"]):
            for kv in (0, 1):
                assert torch.equal(receiver.layout.tensors[layer][kv][dst], want[layer][kv][src])
        assert receiver.num_pending == 0
    finally:
        if stalled is not None:
            stalled.abort()
        sender.close()
        receiver.close()
