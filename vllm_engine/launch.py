"""Starting engine vllm for a worker: its vLLM server (this worker's child, on free loopback ports) or the one
already serving beside it (a pod's `vllm` container), waited for until healthy, then the `VllmEngine` over it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import uuid

import httpx

from splitserve.common.config import ClusterSpec
from splitserve.common.model_files import resolve_model
from splitserve.common.proc import free_ports
from splitserve.vllm_engine.connectors import connector
from splitserve.vllm_engine.control import ControlServer
from splitserve.vllm_engine.engine import VllmEngine, events_socket, model_facts
from splitserve.vllm_engine.server import (
    VllmPorts,
    VllmPortTaken,
    VllmServer,
    command,
    disaggregated,
    environment,
    inline_cores,
)
from splitserve.vllm_engine.wire import parse_load

log = logging.getLogger("splitserve.vllm")


# a port picked free is free only until the server binds it, seconds later; another process's connection or
# listener can take it meanwhile (seen under two test processes' clusters starting at once): start again on others
PORT_ATTEMPTS = 3


async def launch(spec: ClusterSpec, role: str, side_channel_host: str, attach_url: str | None = None,
                 stop: asyncio.Event | None = None) -> VllmEngine:
    """Start this worker's vLLM server (or attach to the one beside it at `attach_url`), wait until it is
    healthy, and return the engine over it, started. A server that could not bind a port picked for it is
    started again on other ports, up to PORT_ATTEMPTS times."""
    for attempt in range(2, PORT_ATTEMPTS + 1):
        try:
            return await _launch(spec, role, side_channel_host, attach_url, stop)
        except VllmPortTaken as e:
            if attach_url is not None:
                raise
            log.warning("%s; starting it again on other ports (attempt %d of %d)", e, attempt, PORT_ATTEMPTS)
    return await _launch(spec, role, side_channel_host, attach_url, stop)


async def _launch(spec: ClusterSpec, role: str, side_channel_host: str, attach_url: str | None,
                  stop: asyncio.Event | None) -> VllmEngine:
    model_dir = resolve_model(spec.model.name, need_weights=spec.model.load_format != "dummy")
    server = None
    events = None
    pool_worker = None
    control = None
    if attach_url is None:
        ports = VllmPorts(*free_ports(4))
        url = f"http://127.0.0.1:{ports.http}"
        events = events_socket(f"tcp://127.0.0.1:{ports.events}")
        # the pool connector's name: unique per server on this host (a server rendered for a pod names itself)
        identity = (f"{socket.gethostname()}-{ports.http}.vllm-pool", uuid.uuid4().hex[:16])
        pool_worker = identity[0] if spec.kv_pool.enabled else None
        server = VllmServer(command(spec, role, str(model_dir), ports, pool_identity=identity),
                            environment(spec, role, ports, side_channel_host), url, spec.vllm.startup_seconds,
                            cores=inline_cores(spec, role))
        server.start()
    else:
        pool_worker = f"{socket.gethostname()}.vllm-pool" if spec.kv_pool.enabled else None
        ports = VllmPorts(0, spec.vllm.events_port, spec.vllm.side_channel_port, spec.vllm.control_port)
        url = attach_url.rstrip("/")
        events = events_socket(f"tcp://127.0.0.1:{ports.events}")
        server = VllmServer([], {}, url, spec.vllm.startup_seconds)  # not ours to start or stop: health only
    if disaggregated(spec, role) and connector(spec).control:  # bound before the server's connectors dial it
        control = ControlServer(f"tcp://127.0.0.1:{ports.control}", spec.model.tensor_parallel_size)
        control.bind()
    flag = threading.Event()
    watcher = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if watcher is not None:
        watcher.add_done_callback(lambda _: flag.set())
    try:
        await asyncio.to_thread(server.wait_healthy, flag)
    except BaseException:
        events.close(linger=0)
        if control is not None:
            await control.close()
        if attach_url is None:
            await asyncio.to_thread(server.stop)
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        models = (await client.get("/v1/models")).json()
        metrics = (await client.get("/metrics")).text
    max_len = spec.model.max_model_len
    with contextlib.suppress(KeyError, IndexError, TypeError):
        max_len = int(models["data"][0]["max_model_len"])
    if not max_len:
        raise ValueError("the vLLM server did not report its max_model_len")
    facts = model_facts(spec, model_dir, max_len, parse_load(metrics).num_kv_blocks)
    engine = VllmEngine(spec, url, f"tcp://127.0.0.1:{ports.events}", facts,
                        server if attach_url is None else None, events, pool_worker, control,
                        (side_channel_host, ports.side_channel))
    await engine.start()
    log.info("vLLM serving %s at %s (%d KV blocks of %d tokens)", facts.name, url, facts.num_kv_blocks,
             facts.block_size)
    return engine
