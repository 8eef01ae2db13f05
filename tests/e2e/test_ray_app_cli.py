"""`splitserve serve-ray --print-config` as a process prints the Serve config the tests build in process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

pytest.importorskip("ray.serve")

from unit.hosts.test_ray_app import LOCAL

from splitserve.common.config_file import load  # noqa: E402
from splitserve.hosts.ray.app import serve_config  # noqa: E402

pytestmark = pytest.mark.slow


def test_print_config_is_the_serve_config() -> None:
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve-ray", "-f", str(LOCAL), "--print-config",
                          "--host", "0.0.0.0"], capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(out) == serve_config(load(LOCAL), "0.0.0.0")
