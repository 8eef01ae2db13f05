"""`splitserve up --autoscale` never starts more workers than this machine holds: the bound from cores and
memory (injected here), how it reaches the law (its budget), and the one line that says which limit applied."""

from __future__ import annotations

import logging

from splitserve.autoscaler.bounds import Bounds, clamp
from splitserve.common.config_file import load
from splitserve.hosts.local.autoscale import GiB, LocalAutoscaler, Machine, local_bound, worker_memory_bytes

EXAMPLE = "deploy/examples/local-cpu.yaml"


def spec(**overrides):
    from pathlib import Path

    return load(Path(__file__).resolve().parents[3] / EXAMPLE, overrides).spec


def test_the_bound_is_the_tighter_of_cores_and_memory():
    s = spec()
    per = int(1.7 * GiB)
    assert local_bound(s, Machine(cores=2, available_bytes=64 * GiB), per).workers == 2  # cores
    b = local_bound(s, Machine(cores=64, available_bytes=8 * GiB), per)
    assert b.workers == 4 and "bound by memory" in b.reason  # 0.9 x 8 GiB / 1.7 GiB
    assert "64 cores" in b.reason and "8.0 GiB available" in b.reason and "1.7 GiB per worker" in b.reason
    # never below what was asked for at start (1 prefill + 1 decode)
    small = local_bound(s, Machine(cores=1, available_bytes=1 * GiB), per)
    assert small.workers == 2 and "at start" in small.reason


def test_an_explicit_budget_replaces_the_core_bound_but_not_memory():
    s = spec(**{"autoscaling.gpu_budget": 3})
    per = int(1.7 * GiB)
    assert local_bound(s, Machine(cores=2, available_bytes=64 * GiB), per).workers == 3
    assert local_bound(s, Machine(cores=2, available_bytes=4 * GiB), per).workers == 2


def test_a_worker_is_estimated_from_its_weights_and_kv_cache():
    # SmolLM2-135M float32 (0.54 GB) + 512 MiB of KV + the runtime: 1.74 GiB resident measured
    s = spec(**{"prefill.engine.kv_cache_memory": "512MiB", "decode.engine.kv_cache_memory": "512MiB"})
    assert 1.74 * GiB < worker_memory_bytes(s) < 2.0 * GiB
    more_kv = spec(**{"prefill.engine.kv_cache_memory": "512MiB", "decode.engine.kv_cache_memory": "2GiB"})
    assert worker_memory_bytes(more_kv) - worker_memory_bytes(s) == 1.5 * GiB  # the larger role's KV counts


class FakeLauncher:
    def __init__(self, resource) -> None:
        self.resource = resource
        self.host = "127.0.0.1"
        self.components: dict = {}


def test_the_launcher_s_law_gets_the_bound_as_its_budget_and_says_so(caplog):
    launcher = FakeLauncher(load(None, {"autoscaling.mode": "slo"}))
    with caplog.at_level(logging.INFO, logger="splitserve.autoscaler.local"):
        bound = LocalAutoscaler.bound(launcher, Machine(cores=3, available_bytes=64 * GiB))
    assert bound.workers == 3 and launcher.resource.spec.autoscaling.gpu_budget == 3
    assert launcher.components["autoscaler"]["max_workers"] == 3
    [line] = [r.getMessage() for r in caplog.records if "at most" in r.getMessage()]
    assert "at most 3 workers on this machine (3 cores" in line
    # the law then never asks for more than that, however much load it sees
    p, d, notes = clamp(1, 8, Bounds.from_spec(launcher.resource.spec))
    assert (p, d) == (1, 2) and notes


def test_up_shares_the_cores_this_process_may_use_not_the_machine_s():
    """A process pinned to one core (a container's cpuset, taskset) gives its one worker one engine thread; the
    same plan unpinned gives it every core it may use."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / EXAMPLE

    def threads(pin: bool) -> int:
        script = textwrap.dedent(f"""
            import os
            if {pin}:
                os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
            from splitserve.common.config_file import load
            from splitserve.hosts.local.launcher import Launcher
            launcher = Launcher(load({str(example)!r}, {{"mode": "colocated"}}), "127.0.0.1")
            launcher.plan()
            print(launcher.resource.spec.decode.engine.threads)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    assert threads(pin=True) == 1
    assert threads(pin=False) == len(os.sched_getaffinity(0))
