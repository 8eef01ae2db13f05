"""A cluster started with `--host 127.0.0.1` listens on loopback only: no process of its tree (gateway, workers,
their KV transfer, the bundled Redis) has a socket bound to another address. The same cluster serves the
gateway's client-closed check: a request whose client left before the end is counted as status 499, not 200."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
from support.serving import Up, metric_sum, scrape

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net")]


@pytest.fixture(scope="module")
def cluster():
    up = Up("--host", "127.0.0.1", "--routing", "kv_aware")
    yield up
    up.stop()


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def bound_sockets() -> dict[int, tuple[str, str, int]]:
    """socket inode -> (protocol, local address, port) of every TCP listener and bound UDP socket here."""
    out = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        for line in lines:
            f = line.split()
            local, state, inode = f[1], f[3], int(f[9])
            if proto.startswith("tcp") and state != "0A":  # TCP: listeners only
                continue
            out[inode] = (proto, str(_address(local)), int(local.rsplit(":", 1)[1], 16))
    return out


def sockets_of(pid: int, table: dict[int, tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    found = []
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, PermissionError):
        return found
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in table:
                found.append(table[inode])
    return found


def is_loopback(address: str) -> bool:
    a = ipaddress.ip_address(address)
    mapped = getattr(a, "ipv4_mapped", None)  # gRPC binds [::ffff:127.0.0.1]
    return a.is_loopback or (mapped is not None and mapped.is_loopback)


def test_loopback_means_loopback(cluster):
    # a request through the whole path first, so every lazily opened listener (KV transfer) exists
    r = httpx.post(cluster.url + "/v1/completions", json={"model": "smollm2", "prompt": [1000 + i for i in range(600)],
                                                        "max_tokens": 2}, timeout=300)
    assert r.status_code == 200, r.text
    table = bound_sockets()
    pids = descendants(cluster.proc.pid)
    assert len(pids) >= 5  # up, a gateway, two workers, Redis
    listening = {pid: sockets_of(pid, table) for pid in pids}
    assert any(listening.values())
    outside = {pid: [s for s in socks if not is_loopback(s[1])] for pid, socks in listening.items()}
    outside = {pid: (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120], s)
               for pid, s in outside.items() if s}
    assert outside == {}, f"bound beyond loopback: {outside}"


def gateway_requests(cluster, status: str) -> float:
    return metric_sum(scrape(cluster.url), "splitserve_requests_total", endpoint="completions", status=status)


def worker_metric(cluster, name: str, **labels: str) -> float:
    return sum(metric_sum(scrape(c["metrics"]), name, **labels) for role in ("prefill", "decode")
               for c in cluster.components.get(role, []))


def wait_until_idle(cluster) -> None:
    deadline = time.monotonic() + 240
    while worker_metric(cluster, "splitserve_worker_running_requests") > 0:
        assert time.monotonic() < deadline, "a worker still runs a request 240 s later"
        time.sleep(0.1)


def test_a_client_that_left_is_counted_499_not_200(cluster):
    before_200, before_499 = gateway_requests(cluster, "200"), gateway_requests(cluster, "499")
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
    # streaming: read the first chunk, then hang up
    with httpx.Client(timeout=120) as client, \
            client.stream("POST", cluster.url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    wait_until_idle(cluster)
    finished = worker_metric(cluster, "splitserve_worker_requests_total", rpc="generate", status="ok")
    # unary: the client times out long before its 4096 tokens are done; the gateway cancels the generation, so
    # the worker aborts it instead of decoding for nobody (finished, it would count one more "ok")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.url + "/v1/completions", json={**body, "max_tokens": 4096},
                   timeout=httpx.Timeout(120, read=1.0))
    deadline = time.monotonic() + 240
    while gateway_requests(cluster, "499") - before_499 < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gateway_requests(cluster, "499") - before_499 == 2
    assert gateway_requests(cluster, "200") == before_200
    wait_until_idle(cluster)
    assert worker_metric(cluster, "splitserve_worker_requests_total", rpc="generate", status="ok") == finished
    # and a request that ends normally is still a 200
    r = httpx.post(cluster.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and gateway_requests(cluster, "200") == before_200 + 1
    assert worker_metric(cluster, "splitserve_worker_requests_total", rpc="generate", status="ok") == finished + 1


def test_the_probe_sees_a_socket_bound_beyond_loopback():
    """The check above can fail: a listener on every address is reported."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        mine = sockets_of(os.getpid(), bound_sockets())
        assert ("tcp", "0.0.0.0", port) in mine and not is_loopback("0.0.0.0")
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("::1") and not is_loopback("192.0.2.2")
