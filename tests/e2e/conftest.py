"""Fixtures of the end-to-end tests that more than one module uses."""

from __future__ import annotations

import pytest
from support.redis_server import RedisServer
from support.serving import Up


@pytest.fixture(scope="package")
def colocated_one():
    """`splitserve up --mode colocated --decode 1`: a gateway and one colocated SmolLM2 worker, started once for
    the e2e tests, in any module, that only send it requests and read the answers and /proc (stopped when the
    last e2e module is done)."""
    up = Up("--mode", "colocated", "--decode", "1")
    yield up
    assert up.stop() == 0


@pytest.fixture(scope="module")
def redis():
    """A real redis-server of the module's own."""
    server = RedisServer()
    yield server
    server.close()
