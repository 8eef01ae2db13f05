"""A worker's assembly apart from its hosting: `worker.serve` runs until its stop event is set and returns an
exit code, installing no signal handler and never exiting the process, so a Ray Serve replica (or any host)
can run one; `splitserve worker` (`run_process`) is the host that turns SIGTERM into that event."""

from __future__ import annotations

import asyncio
import signal

from support.serving import free_port

from splitserve.common.config_file import load
from splitserve.worker import serve


def test_serve_stops_on_its_event_and_leaves_the_process_alone() -> None:
    resource = load(None, {"model.load_format": "dummy", "model.device": "cpu", "decode.port": free_port(),
                           "decode.metrics_port": free_port(), "decode.drain_seconds": 1.0,
                           "decode.engine.kv_cache_memory": "16MiB"})
    before = signal.getsignal(signal.SIGTERM)

    async def host() -> int:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)  # the host decides when: here, a timer
        return await serve(resource, "both", "127.0.0.1", stop)

    assert asyncio.run(host()) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # no handler of its own
