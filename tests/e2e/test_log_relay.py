"""A vLLM server's own output becomes the worker's JSON log lines: each line at the level vLLM's prefix names
(the prefix dropped, its source kept as a field), unlabelled stdout lines at info and stderr lines (Python
warnings, nanobind's leak report, tracebacks) at warning. The child here prints vLLM's formats; the relay is the
one `VllmServer` runs."""

from __future__ import annotations

import json
import logging
import sys
import time

import pytest

from splitserve.common.logs import JsonFormatter
from splitserve.vllm_engine.server import VllmServer

pytestmark = pytest.mark.slow

CHILD = r"""
import sys
print("INFO 11-28 12:00:01 [api_server.py:1234] Starting vLLM API server on http://127.0.0.1:8200")
print("(EngineCore_DP0 pid=4242) WARNING 11-28 12:00:02 [cpu.py:99] Pin memory is not supported on CPU.")
print("(APIServer pid=4241) ERROR 11-28 12:00:03.123 [core.py:7] engine died")
print("plain text on stdout")
print("/x/y.py:3: DeprecationWarning: old api", file=sys.stderr)
print("nanobind: leaked 40 instances!", file=sys.stderr)
"""


def test_vllm_lines_become_json_records_at_their_own_level(caplog):
    caplog.set_level(logging.DEBUG, logger="splitserve.vllm.server")
    server = VllmServer([sys.executable, "-c", CHILD], {}, "http://127.0.0.1:1", startup_s=10)
    server.start()
    assert server.proc is not None and server.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while len([r for r in caplog.records if r.name == "splitserve.vllm.server"]) < 6:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    got = {r.getMessage(): r for r in caplog.records if r.name == "splitserve.vllm.server"}
    levels = {m: r.levelname for m, r in got.items()}
    assert levels == {
        "Starting vLLM API server on http://127.0.0.1:8200": "INFO",
        "Pin memory is not supported on CPU.": "WARNING",
        "engine died": "ERROR",
        "plain text on stdout": "INFO",
        "/x/y.py:3: DeprecationWarning: old api": "WARNING",
        "nanobind: leaked 40 instances!": "WARNING",
    }
    line = json.loads(JsonFormatter().format(got["Pin memory is not supported on CPU."]))
    assert line["level"] == "warning" and line["logger"] == "splitserve.vllm.server"
    assert line["where"] == "cpu.py:99" and line["process"] == "EngineCore_DP0 pid=4242"
