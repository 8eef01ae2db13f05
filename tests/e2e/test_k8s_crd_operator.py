"""`splitserve operator` as a process: without a namespace said it refuses to start, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_splitserve_operator_needs_its_namespaces_said():
    result = subprocess.run([sys.executable, "-m", "splitserve.cli", "operator"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "splitserve: error: give --namespace NS (repeatable) or --all-namespaces"
